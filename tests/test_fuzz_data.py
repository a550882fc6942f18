"""Fuzzing data files: the prompt JSONL of the Hugging Face kinds (``data.path`` of
hf_sft / hf_grpo / hf_ppo, trainers/hf/tasks.py) and the SFT JSONL of ``sft``
(trainers/lm/sft.py), both read by ``corun.read_jsonl``.

In process, many examples: malformed lines, wrong types, missing and unknown fields,
invalid UTF-8, a BOM, blank lines, CRLF, empty files, lines of megabytes. Every file
loads or fails with one :class:`DataError` line naming ``file:line`` (the first line
that does not decode) or the file. Two real ``corun train`` runs (``sft``, ``hf_sft``)
with a bad line exit 2 with that one line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corun import DataError, read_jsonl, stable_seed
from tests.support.cli import assert_usage_error
from tests.support.fuzz_support import FUZZ, assert_one_line, bounded, corun_many, count
from trainers.hf.tasks import PromptRecord, prompt_batches, read_prompts
from trainers.lm.sft import SFTRecord
from trainers.lm.tasks import CHARS

BOM = b"\xef\xbb\xbf"

# ----------------------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "", "USER"])
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": st.text(max_size=12)}), max_size=3
)
prompt_records = st.one_of(
    st.fixed_dictionaries(
        {"prompt": st.text(max_size=30)}, optional={"answer": st.text(max_size=8)}
    ),
    st.fixed_dictionaries({"messages": messages}, optional={"answer": st.text(max_size=8)}),
)
sft_text = st.text(alphabet=CHARS, max_size=14)
sft_records = st.fixed_dictionaries({"prompt": sft_text, "answer": sft_text})


@st.composite
def mutated(draw: st.DrawFn, records: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    record = dict(draw(records))
    how = draw(st.sampled_from(["keep", "keep", "drop", "unknown", "retype"]))
    if how == "drop" and record:
        record.pop(draw(st.sampled_from(sorted(record))))
    elif how == "unknown":
        record[draw(st.text(max_size=6))] = draw(json_values)
    elif how == "retype" and record:
        record[draw(st.sampled_from(sorted(record)))] = draw(json_values)
    return record


def encoded(record: Any, ascii_only: bool) -> bytes:
    return json.dumps(record, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def line(draw: st.DrawFn, records: st.SearchStrategy[dict[str, Any]]) -> bytes:
    kind = draw(st.sampled_from(["record"] * 4 + ["value", "bytes", "blank", "bad-utf8", "cut"]))
    if kind == "record":
        return encoded(draw(mutated(records)), draw(st.booleans()))
    if kind == "value":  # any JSON (NaN and Infinity included, which JSON forbids)
        return encoded(draw(json_values), draw(st.booleans()))
    if kind == "bytes":
        return draw(st.binary(max_size=24))
    if kind == "blank":
        return draw(st.sampled_from([b"", b"   ", b"\t"]))
    good = encoded(draw(records), False)
    at = draw(st.integers(0, len(good)))
    if kind == "bad-utf8":
        return (
            good[:at]
            + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"]))
            + good[at:]
        )
    return good[:at]  # cut short


@st.composite
def jsonl_files(draw: st.DrawFn, records: st.SearchStrategy[dict[str, Any]]) -> bytes:
    body = draw(st.sampled_from([b"\n", b"\r\n"])).join(draw(st.lists(line(records), max_size=8)))
    return draw(st.sampled_from([b"", BOM])) + body + draw(st.sampled_from([b"", b"\n"]))


# ----------------------------------------------------------------------------- the property


def load_checked(path: Path, data: bytes, load: Callable[[Path], Any], record: type) -> Any:
    """``load(path)``, or None after checking its DataError: one line naming ``path``
    and, for a line that does not decode, that it is the first such line."""
    path.write_bytes(data)
    try:
        with bounded(15):
            return load(path)
    except DataError as exc:
        message = str(exc)
        assert_one_line(message, f"{path}:")
        found = re.match(rf"{re.escape(str(path))}:(\d+): ", message)
        if found:
            lines = data.removeprefix(BOM).splitlines()
            number = int(found[1])
            assert 1 <= number <= len(lines), message
            for before in lines[: number - 1]:
                if before.strip():
                    msgspec.json.decode(before, type=record)  # an earlier line was fine
        return None


@settings(FUZZ, max_examples=300)
@given(data=jsonl_files(prompt_records), seed=st.integers(0, 2**63 - 1))
def test_fuzzed_prompt_files(tmp_path: Path, data: bytes, seed: int) -> None:
    count("data/hf-prompts")
    loaded = load_checked(tmp_path / "prompts.jsonl", data, read_prompts, PromptRecord)
    if loaded is not None:
        train, held_out = loaded
        batches = prompt_batches(tmp_path / "prompts.jsonl", 3, seed, shuffle=True)
        for index in (0, 5):
            assert len(batches.batch(index)) == 3
        for example in [*train, *held_out]:
            stable_seed("held-out", str(example.prompt))


@settings(FUZZ, max_examples=200)
@given(data=jsonl_files(sft_records))
def test_fuzzed_sft_files(tmp_path: Path, data: bytes) -> None:
    count("data/sft")
    load_checked(tmp_path / "sft.jsonl", data, lambda p: read_jsonl(p, SFTRecord), SFTRecord)


MB = 1 << 20
HUGE = [
    ("valid-4MB-prompt", b'{"prompt": "' + b"a" * 4 * MB + b'", "answer": "1"}\n'),
    ("unterminated-4MB", b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "' + b"a" * 4 * MB),
    ("invalid-utf8-4MB", b'{"prompt": "' + b"\xff" * 4 * MB + b'"}\n'),
    ("4MB-of-whitespace", b" " * 4 * MB + b"\n"),
    ("100k-lines", b'{"prompt": "2+2", "answer": "4"}\n' * 100_000),
    ("deep-array-1MB", b'{"prompt": ' + b"[" * MB + b"]" * MB + b"}\n"),
    ("empty", b""),
    ("blank-lines", b"\n \n\t\n"),
    ("bom-only", BOM),
    ("bom-then-record", BOM + b'{"prompt": "1+1", "answer": "2"}\n'),
]


@pytest.mark.parametrize("data", [pytest.param(d, id=name) for name, d in HUGE])
@pytest.mark.parametrize("kind", ["hf", "sft"])
def test_huge_and_empty_files(tmp_path: Path, data: bytes, kind: str) -> None:
    count(f"data/{kind}-huge-or-empty")
    if kind == "hf":
        load_checked(tmp_path / "d.jsonl", data, read_prompts, PromptRecord)
    else:
        load_checked(tmp_path / "d.jsonl", data, lambda p: read_jsonl(p, SFTRecord), SFTRecord)


def test_bom_is_read_past(tmp_path: Path) -> None:
    """A file saved with a BOM by an editor reads like one without (it was line 1's
    'JSON is malformed: invalid character (byte 0)')."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(BOM + b'{"prompt": "1+1", "answer": "2"}\n')
    assert read_jsonl(path, SFTRecord) == [SFTRecord("1+1", "2")]


@pytest.mark.parametrize("make", ["missing", "directory", "fifo"])
def test_not_a_data_file(tmp_path: Path, make: str) -> None:
    """Never a hang: a FIFO as data.path blocked forever (and /dev/zero never ends)."""
    count("data/not-a-file")
    path = tmp_path / "d.jsonl"
    if make == "directory":
        path.mkdir()
    elif make == "fifo":
        os.mkfifo(path)
    with bounded(10), pytest.raises(DataError) as caught:
        read_prompts(path)
    assert_one_line(str(caught.value), str(path))


# ----------------------------------------------------------------------------- real `corun train`

BAD_LINES = [
    ("sft", b'{"prompt": "1+1", "answer": "2"}\n{"prompt": 3, "answer": "2"}\n', ":2: "),
    ("hf_sft", b'{"prompt": "Ann has 3 pens.", "answer": "3"}\n\n{"prompt": "\xff"}\n', ":3: "),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, int, str]]:
    """Each kind trained on a file with a bad line, side by side: (data file, run dir,
    exit status, stderr)."""
    tmp = tmp_path_factory.mktemp("fuzz-data")
    argvs, places = [], []
    for kind, data, _ in BAD_LINES:
        data_path, run_dir = tmp / f"{kind}.jsonl", tmp / f"run-{kind}"
        data_path.write_bytes(data)
        model = '\nmodel = "tiny-llama"' if kind.startswith("hf") else ""
        config = tmp / f"{kind}.toml"
        config.write_text(
            f'[run]\ndir = "{run_dir}"\nsteps = 2\n[log]\nprogress = "off"\n'
            f'[data]\npath = "{data_path}"\nbatch_size = 2\n[trainer]\nkind = "{kind}"{model}\n'
        )
        argvs.append(["train", str(config)])
        places.append((data_path, run_dir))
    results = corun_many(tmp, *argvs)
    return {
        kind: (*place, code, err)
        for (kind, _, _), place, (code, _, err) in zip(BAD_LINES, places, results, strict=True)
    }


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "where"), [(k, w) for k, _, w in BAD_LINES])
def test_corun_train_refuses_bad_data(
    refused: dict[str, tuple[Path, Path, int, str]], kind: str, where: str
) -> None:
    count("data/subprocess")
    data_path, _, code, err = refused[kind]
    assert_usage_error(code, err, f"{data_path}{where}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k, _, _ in BAD_LINES])
def test_refused_data_leaves_no_run_directory(
    refused: dict[str, tuple[Path, Path, int, str]], kind: str
) -> None:
    assert not refused[kind][1].exists(), sorted(os.listdir(refused[kind][1]))
