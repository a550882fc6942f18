"""A verifiers taskset over local JSONL data (no hub): one task per line,
``{"prompt": ..., "answer": ...}``, scored by a rubric reward — 1 when the reply's
last number is the answer. corun's run writes its word problems to such a file
(trainers/hf/verifiers_task.py); any file of that shape works.

Runs in the verifiers environment (imported by id, ``corun-word-problems``), never in
corun's: it imports verifiers, not corun.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class WordProblemData(vf.TaskData):
    answer: str = ""


class WordProblem(vf.Task[WordProblemData]):
    @vf.reward
    async def numeric_match(self, trace: vf.Trace) -> float:
        """1 when the last number of the final reply equals the answer, else 0."""
        numbers = NUMBER.findall(trace.last_reply or "")
        return float(bool(numbers) and float(numbers[-1]) == float(self.data.answer))


class WordProblemsConfig(vf.TasksetConfig):
    path: str = ""
    """The JSONL file of problems."""


class WordProblems(vf.Taskset[WordProblem, WordProblemsConfig]):
    def load(self) -> Iterator[WordProblem]:
        lines = Path(self.config.path).read_text().splitlines()
        for line in filter(str.strip, lines):
            row = json.loads(line)
            yield WordProblem(WordProblemData(prompt=row["prompt"], answer=row["answer"]))


__all__ = ["WordProblems"]
