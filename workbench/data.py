"""Prompt sources: where Tasks come from. Each returns a list of `Task`s.

A record (dict) becomes a Task as follows: `messages` (a chat message list) or `prompt` (a
string, becomes one user message, after an optional `system`); `tools`; `label` (or `answer`);
everything else goes to `info`. Toy tasks generate their own (see workbench/examples).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from .agents import Task


def task_from_record(record: dict, where: str = "record") -> Task:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a task must be an object, got {type(record).__name__}")
    r = dict(record)
    if "messages" in r:
        messages = r.pop("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{where}: 'messages' must be a list of chat messages with a 'role'")
    elif "prompt" in r:
        messages = [{"role": "user", "content": str(r.pop("prompt"))}]
        if "system" in r:
            messages.insert(0, {"role": "system", "content": str(r.pop("system"))})
    else:
        raise ValueError(f"{where}: a task needs 'messages' or 'prompt' (got keys {sorted(r)})")
    label = r.pop("label", r.pop("answer", None))
    tools = r.pop("tools", None)
    task_id = str(r.pop("id", "")) or None
    t = Task(messages=messages, tools=tools, label=label, info=r)
    if task_id:
        t.id = task_id
    return t


def tasks_from_list(records: Iterable[dict | Task]) -> list[Task]:
    return [r if isinstance(r, Task) else task_from_record(r, f"item {i}") for i, r in enumerate(records)]


def tasks_from_jsonl(path: str | Path) -> list[Task]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such prompt file: {path}")
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON: {e}") from e
        tasks.append(task_from_record(record, f"{path}:{n}"))
    return tasks


def tasks_from_datasets(path: str | Path, split: str = "train", limit: int | None = None) -> list[Task]:
    """A local data file (json/jsonl/csv/parquet) read through HF `datasets` (no hub access)."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {path}")
    kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"unsupported data file type {path.suffix!r}: use .jsonl, .json, .csv or .parquet")
    ds = datasets.load_dataset(kind, data_files=str(path), split=split)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    # a table has every column in every row: a field missing from a record reads as None
    return [task_from_record({k: v for k, v in r.items() if v is not None}, f"{path}[{i}]") for i, r in enumerate(ds)]
