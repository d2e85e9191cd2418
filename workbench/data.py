"""Prompt sources: where Tasks come from. Each returns a list of `Task`s.

A record (dict) becomes a Task as follows: `messages` (a chat message list) or `prompt` (a
string, becomes one user message, after an optional `system`); `tools`; `label` (or `answer`);
everything else goes to `info`. Toy tasks generate their own (see workbench/examples).

Data files (`load_tasks`): JSONL, Parquet, CSV, Arrow or a `datasets.save_to_disk` directory,
with a field mapping (`fields="gsm8k"`: `question` -> prompt, the answer after `####` -> label).
`TaskDataset` serves a pool in epochs, each a seeded shuffle, by data position, so the loop can
record where it is and a resumed run continue there (see TaskDataset).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Iterable

from .agents import Task


def task_from_record(record: dict, where: str = "record") -> Task:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a task must be an object, got {type(record).__name__}")
    r = dict(record)
    if "messages" in r:
        messages = _json_messages(r.pop("messages"))
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{where}: 'messages' must be a list of chat messages with a 'role'")
        messages = [dict(m) for m in messages]
        _system_into(messages, r, "messages", where)
    elif "prompt" in r:
        prompt = _json_messages(r.pop("prompt"))
        if isinstance(prompt, list):
            # TRL's conversational format: the prompt is the chat messages (str() of it trained on its
            # Python repr, the list printed into the user turn)
            if not all(isinstance(m, dict) and "role" in m for m in prompt):
                raise ValueError(f"{where}: a list 'prompt' must be chat messages with a 'role'")
            messages = [dict(m) for m in prompt]
            _system_into(messages, r, "prompt", where)
        elif isinstance(prompt, (str, int, float)) and not isinstance(prompt, bool):
            if not str(prompt).strip():  # (a CSV's empty cell, or a row of empty cells a spreadsheet left: trained on)
                raise ValueError(f"{where}: 'prompt' is empty")
            messages = [{"role": "user", "content": str(prompt)}]
            _system_into(messages, r, "prompt", where)
        else:
            raise ValueError(f"{where}: 'prompt' must be a string or a list of chat messages, got {type(prompt).__name__}")
    else:
        raise ValueError(f"{where}: a task needs 'messages' or 'prompt' (got keys {sorted(r)})")
    if messages and messages[-1].get("role") == "assistant":
        # an SFT record (the conversation with its worked answer): the policy was shown the answer it
        # is rewarded for, every reward and pass@k inflated, silently. A prompt ends with the user's
        # (or a tool's) turn; where the record also has a prompt column, that is the prompt
        said = str(messages[-1].get("content"))[:60]
        hint = (" The record has a 'prompt' column too: map it, fields={'prompt': 'prompt'}." if "prompt" in r else
                " Drop that turn, or map the prompt's column with fields={'prompt': ...}.")
        raise ValueError(f"{where}: the task's messages end with an assistant turn ({said!r}): a training prompt "
                         f"holding its answer (an SFT record?); a prompt ends with the user's or a tool's turn.{hint}")
    # (the default of pop("label", ...) is evaluated first: it dropped "answer" even beside a label)
    label = r.pop("label") if "label" in r else r.pop("answer", None)
    tools = _tools(r.pop("tools", None), where)
    task_id = r.pop("id", None)
    task_id = None if task_id is None else (str(task_id) or None)  # (a null id read as the id 'None' for every such task)
    t = Task(messages=messages, tools=tools, label=label, info=r)
    if task_id:
        t.id = task_id
    return t


def _json_messages(value):
    """Chat messages written as JSON text (a CSV cell: TRL's conversational prompt exported), as the
    list they are; any other value as it is. (A prompt cell of JSON messages was one user turn of
    raw JSON, the system message inside it.)"""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(decoded, list) and decoded and all(isinstance(m, dict) and "role" in m for m in decoded):
            return decoded
    return value


def _tools(tools, where: str) -> list[dict] | None:
    """A record's tools: a list of tool schemas, or its JSON text (a CSV cell, the usual function-
    calling dataset layout: kept a string, the template walked it character by character and every
    episode of the task failed)."""
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: 'tools' is text but not JSON: {e}") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of tool schemas (objects), got {type(tools).__name__}")
    return tools or None


def _without_nulls(value, keep: tuple = ()):
    """`value` with every mapping's None entries dropped, at any depth, but for the keys in `keep`:
    a columnar file (Parquet, Arrow) stores nested records as one struct type over all rows, so each
    row read back holds every key any row has, as None (a tool's schema listed the other tools'
    parameters as null, which the template rendered into the prompt)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v, keep) for k, v in value.items() if v is not None or k in keep}
    if isinstance(value, list):
        return [_without_nulls(v, keep) for v in value]
    return value


def _columnar(records: list[dict]) -> list[dict]:
    """Records of a columnar source with the nulls of their nested task fields dropped
    (_without_nulls; a message's content stays: None there is an assistant turn of tool calls)."""
    for r in records:
        for field, keep in (("tools", ()), ("messages", ("content",)), ("prompt", ("content",))):
            if isinstance(r.get(field), (list, dict)):
                r[field] = _without_nulls(r[field], keep)
    return records


def _system_into(messages: list[dict], record: dict, field: str, where: str) -> None:
    """A record's `system` field as the conversation's system message (left in info, the model never
    saw it); an empty one (a nullable column) is none, one equal to the conversation's own is it."""
    system = record.pop("system", None)
    if system is None or not str(system).strip():
        return
    own = [m.get("content") for m in messages if m["role"] == "system"]
    if own and own != [str(system)]:
        raise ValueError(f"{where}: a 'system' field and another system message in {field!r}: keep one")
    if not own:
        messages.insert(0, {"role": "system", "content": str(system)})


def tasks_from_list(records: Iterable[dict | Task], prefix: str = "item") -> list[Task]:
    """Tasks of a list: a dict without an id gets its place ("item-3"), the same in every process
    (a random one changed at every resume, and the record's task_id with it). `prefix`: another
    list's ("eval-item": a held-out list's first task and a training list's were both item-0)."""
    out = []
    for i, r in enumerate(records):
        if isinstance(r, dict) and r.get("id") in (None, ""):
            r = {**r, "id": f"{prefix}-{i}"}
        out.append(r if isinstance(r, Task) else task_from_record(r, f"item {i}"))
    return out


# ----------------------------------------------------------------------------- files with a field mapping
# Field presets for load_tasks(fields=...): which column becomes the prompt and which the label.
# "gsm8k": `question` is the prompt, `answer` the worked solution whose final answer follows
# '####' (the label is that final answer; the whole solution stays in info["solution"]).
FIELD_PRESETS = {"gsm8k": {"prompt": "question", "label": "answer", "final_answer": "####"}}
TASK_FIELDS = ("prompt", "messages", "system", "label", "tools", "id")


def final_answer(solution: str, marker: str = "####") -> str:
    """The final answer of a worked solution: the first line after the last `marker`, stripped,
    with thousands separators removed ("#### 1,234" -> "1234"; any other comma, a decimal one, is
    refused) and a currency or percent sign or
    a unicode minus read as the number ("#### $18" -> "18", "#### −3" -> "-3"). A solution
    without the marker, or whose final answer is not a number, is an error naming it (a label that
    silently became the whole solution would never match; "$18" failed every episode of its task)."""
    text = str(solution)
    if marker not in text:
        raise ValueError(f"no {marker!r} final answer in {text[-80:]!r}")
    tail = text.rsplit(marker, 1)[1].strip()
    answer = (tail.splitlines() or [""])[0].strip().replace("\u2212", "-").strip("$%€£ ")
    # commas only as thousands groups, as the graders read them: a decimal comma ("#### 2,50", a
    # translated set) had them all stripped, the label 250, a right answer scored 0, a wrong one paid
    if "," in answer and not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d*)?", answer):  # ("1,234." ends a sentence)
        raise ValueError(f"the final answer after {marker!r} is not a number (commas only as thousands groups, "
                         f"\"1,234\"): {tail[:80]!r}")
    answer = answer.replace(",", "")
    try:
        float(answer)
    except ValueError:
        raise ValueError(f"the final answer after {marker!r} is not a number: {tail[:80]!r}") from None
    return answer


def load_records(path: str | Path, split: str = "train") -> list[dict]:
    """The rows of a local data file as dicts: .jsonl (one object per line), .json (that, or one
    array of objects), .parquet
    (pyarrow), .csv (every field the text the file holds), .arrow (through `datasets`), or a
    directory written by `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` (`split`
    picks the split; a file has none: any split but "train" is refused). A CSV row of more or fewer
    cells than the header is refused by line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {path}")
    if not path.is_dir() and split != "train":  # (it was ignored: the "test" split of a file read its rows, the
        # training problems an evaluation scored)
        raise ValueError(f"{path} is one file, without splits: split={split!r} names none of it; give the "
                         f"held-out file's own path")
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path}: no split {split!r} (has {sorted(ds)})")
            ds = ds[split]
        elif split != "train":  # a saved Dataset (dataset["train"].save_to_disk): its rows were "test"'s too
            raise ValueError(f"{path} holds one Dataset, without splits: split={split!r} names none of it; give the "
                             f"held-out data's own path (or save the DatasetDict with its splits)")
        return _columnar([dict(r) for r in ds])
    if path.suffix in (".jsonl", ".json"):
        if path.suffix == ".json" and path.read_text(encoding="utf-8-sig").lstrip().startswith("["):
            try:  # one JSON array of records (pretty-printed or not)
                return json.loads(path.read_text(encoding="utf-8-sig"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{e.lineno}: not valid JSON: {e}") from e
        records = []
        # lines as JSON Lines ends them ("\n"): str.splitlines also broke a line at U+2028, U+2029 and
        # \x85, which json.dumps(ensure_ascii=False) leaves raw inside strings ("Unterminated string")
        with open(path, encoding="utf-8-sig", newline="") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON: {e}") from e
        return records
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return _columnar(pq.read_table(path).to_pylist())
    if path.suffix == ".csv":
        # the stdlib's reader, not datasets' (pandas infers column types: labels "3" and "007" became
        # 3 and 7, "3.50" 3.5, an empty cell None, and a task's label is compared as text)
        import csv

        # (utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which named the first column
        # '\ufeffprompt')
        # (the stdlib's default cell limit, 128 KiB, refused long agentic prompts with an error naming no file)
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader, rows = csv.DictReader(f), []
            for r in reader:
                # a row of more cells than columns (an unquoted comma: "1,000") or fewer: DictReader put
                # the extra under None and filled the missing with None, a prompt cut and a label shifted
                if None in r or None in r.values():
                    cells = sum(v is not None for k, v in r.items() if k is not None) + len(r.get(None) or ())
                    raise ValueError(f"{path}:{reader.line_num}: {cells} "
                                     f"cell(s) for the header's {len(reader.fieldnames)} columns (a comma in a "
                                     f"cell needs the cell in double quotes)")
                rows.append(r)
            return rows
    if path.suffix == ".arrow":
        import datasets

        return _columnar([dict(r) for r in datasets.Dataset.from_file(str(path))])
    raise ValueError(f"unsupported data file {str(path)!r}: use .jsonl, .json, .parquet, .csv, .arrow or a "
                     f"datasets.save_to_disk directory")


def held_out_split(path: str | Path) -> str:
    """The split held-out tasks are read from when none is named: a `datasets` directory of several
    splits gives its "test" split (its "train" split was read: the held-out evaluation ran on the
    training problems), one of a single split other than "train" that split; a file has no splits
    ("train", unread)."""
    path = Path(path)
    meta = path / "dataset_dict.json"
    if not (path.is_dir() and meta.is_file()):
        return "train"
    splits = json.loads(meta.read_text()).get("splits") or []
    if "test" in splits:
        return "test"
    if len(splits) == 1 and splits[0] != "train":  # (a lone "train" split is the training problems)
        return splits[0]
    raise ValueError(f"{path} holds the splits {splits}: name the held-out one, e.g. "
                     f"{{'path': {str(path)!r}, 'split': {splits[-1]!r}}}")


def load_tasks(path: str | Path, fields: str | dict | None = None, template: str | None = None,
               split: str = "train", limit: int | None = None) -> list[Task]:
    """Tasks from a local data file (see load_records) with a field mapping.

    `fields`: a preset name (FIELD_PRESETS, e.g. "gsm8k") or a dict from a task field
    (`prompt`, `messages`, `system`, `label`, `tools`, `id`) to the file's column, plus an
    optional `final_answer` marker: the label is then the text after it (see final_answer).
    None: the columns already carry the task fields (task_from_record). `template`: a
    str.format template over the row's columns for the prompt (e.g. "{question}\\nEnd with
    '#### <number>'."). Columns not mapped go to `info`. A task's id is the row's `id` column
    if mapped, else `<file stem>:<row>` (a directory's `<name>/<split>:<row>`), so the same file gives the same ids in every process
    (a resumed run names its tasks as the first one did)."""
    path = Path(path)
    if limit is not None:  # (numpy's integers too: operator.index)
        import operator

        try:
            if isinstance(limit, bool) or operator.index(limit) < 0:
                raise TypeError
        except TypeError:
            raise ValueError(f"limit must be a whole number >= 0 (the first rows read) or None, got {limit!r}") from None
        limit = operator.index(limit)
    records = load_records(path, split)
    columnar = path.is_dir() or path.suffix in (".parquet", ".arrow")
    if limit is not None:
        records = records[:limit]
    mapping = FIELD_PRESETS.get(fields) if isinstance(fields, str) else fields
    if isinstance(fields, str) and mapping is None:
        raise ValueError(f"unknown field preset {fields!r}; presets: {sorted(FIELD_PRESETS)} (or a dict)")
    mapping = dict(mapping or {})
    marker = mapping.pop("final_answer", None)
    unknown = sorted(set(mapping) - set(TASK_FIELDS))
    if unknown:
        raise ValueError(f"fields: {unknown} are not task fields; map any of {TASK_FIELDS} to a column")
    tasks = []
    for i, row in enumerate(records):
        where = f"{path}[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be an object, got {type(row).__name__}")
        missing = sorted(c for c in mapping.values() if c not in row)
        if missing:
            raise ValueError(f"{where}: no column(s) {missing} for fields={fields!r}; the row has {sorted(row)}")
        record = {k: v for k, v in row.items() if k not in mapping.values() and v is not None}
        # where the mapping or the template makes the prompt, a column named like a prompt field is
        # data (info), not a second prompt: an SFT mirror's `messages` column (the worked answer in
        # its assistant turn) took over from fields="gsm8k" and its template, the solution in the prompt
        aside = {k: record.pop(k) for k in ("messages", "prompt") if k in record and k not in mapping and (
            template is not None or {"messages", "prompt"} & set(mapping))}
        record.update({field: row[col] for field, col in mapping.items()})
        if columnar:  # a mapped column's leftover nulls (_columnar read the columns named like task fields only)
            record.update(_columnar([{f: record[f] for f in ("tools", "messages", "prompt") if f in mapping}])[0])
        if template is not None:
            try:
                # a null column formatted as "" (as the same CSV cell reads): "None" was written into the prompt
                record["prompt"] = template.format(**{k: "" if v is None else v for k, v in row.items()})
            except KeyError as e:
                raise ValueError(f"{where}: template names column {e} that the row lacks (has {sorted(row)}); "
                                 f"a literal brace is written {{{{ or }}}}") from None
            except (IndexError, ValueError, AttributeError) as e:  # ("{0}", "{question", "{q.x}": unnamed otherwise)
                raise ValueError(f"{where}: template {template[:80]!r} does not format: {e}; a literal brace is "
                                 f"written {{{{ or }}}}") from None
        if marker is not None and "label" not in record and "answer" in record:
            # the label task_from_record takes from an unmapped `answer` column: the marker applies
            # to it too (it was skipped, the whole worked solution the label, every episode scored 0)
            record["label"] = record.pop("answer")
        if marker is not None and "label" in record:
            try:
                record["solution"] = record["label"]
                record["label"] = final_answer(record["label"], marker)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        if record.get("id") in (None, ""):  # (an empty CSV cell too: a random id, another in every process;
            # a directory's split named too: its train and test tasks were both gsm:0, gsm:1, ...)
            record["id"] = f"{path.name}/{split}:{i}" if path.is_dir() else f"{path.stem}:{i}"
        task = task_from_record(record, where)
        task.info.update(aside)
        tasks.append(task)
    return tasks


class TaskDataset:
    """A pool of tasks served in epochs, each epoch a seeded shuffle of the pool. Position p is
    the p-th task drawn since the run began: epoch p // len, slot p % len of that epoch's order
    (numpy's permutation seeded by (seed, epoch); `shuffle=False`: the file's order every epoch).

    `take(position, n)` is a pure function of its arguments, so the loop keeps the position,
    advances it by every task it draws (dynamic sampling's replacements too), records it per
    step (`data_position`, `data_next` in metrics.jsonl) and in the checkpoint's run_state
    (`data_position`): a resumed run draws exactly the tasks the first would have drawn next.
    Called as `source(n, seed)` (the plain task-source contract, whose seed the loop gives as the
    data position: loop.draw_tasks) it serves the n tasks from position `seed`: as a step number
    (position seed * n), a source wrapping it (a lambda, a filter) drew positions n times too far
    apart, each epoch sampled with replacement, some tasks never drawn. (A source that draws only
    part of each chunk from it, a mix of two datasets, must pass the positions of its own share:
    k of every n tasks from `a` is a(k, seed // n * k) (the chunk's index times its share; seed // 2
    for half of an odd n skipped and repeated tasks), or its epochs skip tasks. A loop of one's own calling ds(n, step) gets
    overlapping windows: ds.take(step * n, n).)"""

    def __init__(self, tasks: Iterable[dict | Task], seed: int = 0, shuffle: bool = True):
        self.tasks = tasks_from_list(tasks)
        if not self.tasks:
            raise ValueError("a TaskDataset needs at least one task")
        self.seed, self.shuffle = int(seed), shuffle
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_file(cls, path: str | Path, fields: str | dict | None = None, template: str | None = None, seed: int = 0,
                  shuffle: bool = True, split: str = "train", limit: int | None = None) -> "TaskDataset":
        return cls(load_tasks(path, fields, template, split, limit), seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.tasks)

    def order(self, epoch: int) -> list[int]:
        """The pool's indices in the order epoch `epoch` serves them."""
        if not self.shuffle:
            return list(range(len(self.tasks)))
        if epoch not in self._orders:
            import numpy as np

            if len(self._orders) > 8:  # interactive draws visit far epochs; keep a few
                self._orders.clear()
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks)).tolist()
        return self._orders[epoch]

    def take(self, position: int, n: int) -> list[Task]:
        """The n tasks from `position` on (crossing into the next epoch's order where needed)."""
        if position < 0 or n < 0:
            raise ValueError(f"take(position={position}, n={n}): both must be >= 0")
        size = len(self.tasks)
        return [self.tasks[self.order(p // size)[p % size]] for p in range(position, position + n)]

    def epoch(self, position: int) -> int:
        return position // len(self.tasks)

    def __call__(self, n: int, seed: int) -> list[Task]:
        return self.take(seed, n)
