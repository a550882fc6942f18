"""What the tests share, in one place: the test files import helpers from here, not
from conftest.py nor from one another (a few share a config table or a reference
implementation with a neighbour):

- config: ``make_config``, a run config for an in-process run in a tmp dir;
- processes: the repository root, the ``corun`` command and its environment, /proc
  queries (alive, children, process groups) and ``wait_until``;
- corun_process: ``corun train`` as a real subprocess (the ``start_corun`` fixture)
  and the teardown contract's checks;
- cli: ``corun``'s command line in process (the ``restore_process_state`` fixture)
  or as a subprocess, and its one-line usage errors;
- state: bitwise comparison of trainer state trees;
- fakes, faults, dp_trainers, ray_trainers: trainers loaded by ``kind`` (fakes, fault
  injection, data-parallel global batches, dying Ray workers);
- loops: the hand-written reference loop the parity tests compare against;
- fuzz_support: the fuzz tests' hypothesis profile, counts and guards;
- matrix: a test matrix CI runs in part (the rest marked ``long``);
- storm, storm_checks, storm_procs: the interrupt storm
  (``python -m tests.support.storm --runs 200``);
- vllm_helpers, vllm_fixtures: the vLLM tests' shared checks and trainer, and their
  fixtures (``model_dir``, ``chat``, ``policy``).

Fixtures reach the tests through ``pytest_plugins`` in tests/conftest.py.
"""
