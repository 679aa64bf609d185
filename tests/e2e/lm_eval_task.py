"""A local multiple-choice lm-eval task (no dataset download): the docs as JSON lines and a task YAML in `where`,
for the lm-eval tests that drive the server (test_prompt_logprobs.py, test_tokenize.py)."""

from __future__ import annotations

import json
from pathlib import Path

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""
DOCS = [
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " moon", " fence"], "label": 0},
    {"question": "Question: what is the capital of France? Answer:", "choices": [" Paris", " Rome"], "label": 0},
    {"question": "Hello, world! How are you", "choices": [" today?", " there", " doing"], "label": 2},
]


def write_task(where: Path, name: str, docs: list[dict] = DOCS) -> None:
    """`name`'s task.yaml and docs.jsonl in `where` (its --include_path)."""
    data = where / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (where / "task.yaml").write_text(TASK.format(name=name, data=data))
