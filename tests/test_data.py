"""Prompt data from files (workbench.data): GSM8K-format field mapping over JSONL, Parquet and
`datasets` directories, the seeded shuffle per epoch, and positions that a resumed run can
continue from. No engine: these are pure functions of the files."""

from __future__ import annotations

import csv
import json
import re

import pytest

from workbench.data import FIELD_PRESETS, TaskDataset, final_answer, load_records, load_tasks, task_from_record
from workbench.toy.word_problems import SHIPPED, word_problems, write_shipped

TRAIN = SHIPPED / "word_problems_train.jsonl"


def test_shipped_set_is_generated_and_gsm8k_format(tmp_path):
    # the shipped files are exactly what the generator writes (regenerable, seeded)
    for made in write_shipped(tmp_path):
        assert made.read_bytes() == (SHIPPED / made.name).read_bytes()
    rows = load_records(TRAIN)
    assert len(rows) == 128 and set(rows[0]) == {"question", "answer"}
    for r in rows:
        # every worked step's calculator note is right, and the last one is the final answer
        notes = re.findall(r"<<([\d+\-*/ ]+)=(\d+)>>", r["answer"])
        assert notes and all(eval(expr) == int(val) for expr, val in notes)
        assert final_answer(r["answer"]) == notes[-1][1]
    # no test problem is a training one (a name apart: 11 of the 32 one-step test problems were)
    from workbench.toy.word_problems import computation

    for prefix in ("word_problems", "one_step"):
        train, test = (load_records(SHIPPED / f"{prefix}_{s}.jsonl") for s in ("train", "test"))
        assert not set(map(computation, train)) & set(map(computation, test)), prefix
    # the one-step set (recipes/real_model_grpo): one calculator note, numbers below 20
    for r in load_records(SHIPPED / "one_step_train.jsonl"):
        (expr, val), = re.findall(r"<<([\d+\-*/ ]+)=(\d+)>>", r["answer"])
        assert eval(expr) == int(val) == int(final_answer(r["answer"])) and max(map(int, re.findall(r"\d+", expr))) < 20


def test_gsm8k_fields_from_jsonl_parquet_and_datasets_dir(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = word_problems(6, seed=5) + [{"question": "Lin has 1,000 pens and buys 234. How many?",
                                         "answer": "1,000 + 234 = <<1000+234=1234>>1234\n#### 1,234"}]
    jsonl = tmp_path / "gsm.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "gsm.parquet")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "gsm_ds"))

    from_jsonl = load_tasks(jsonl, fields="gsm8k")
    assert [t.label for t in from_jsonl] == [final_answer(r["answer"]) for r in rows]
    assert from_jsonl[-1].label == "1234"  # after '####', thousands separator removed
    t0 = from_jsonl[0]
    assert t0.messages == [{"role": "user", "content": rows[0]["question"]}]
    assert t0.info["solution"] == rows[0]["answer"] and t0.id == "gsm:0"
    for other in (load_tasks(tmp_path / "gsm.parquet", fields="gsm8k"),
                  load_tasks(tmp_path / "gsm_ds", fields="gsm8k", split="test")):
        assert [(t.messages, t.label, t.info) for t in other] == [(t.messages, t.label, t.info) for t in from_jsonl]
    # CSV: every field the text the file holds (datasets' reader made labels "007" and "3.50" 7 and 3.5)
    csv_path = tmp_path / "labels.csv"
    csv_path.write_text('question,answer\n"What is 3.5 + 0?","3.50"\nZero-padded?,007\nEmpty?,\n')
    assert load_records(csv_path) == [{"question": "What is 3.5 + 0?", "answer": "3.50"},
                                      {"question": "Zero-padded?", "answer": "007"}, {"question": "Empty?", "answer": ""}]
    # a dict mapping with a prompt template and a system message; unmapped columns go to info
    custom = load_tasks(jsonl, fields={"label": "answer", "final_answer": "####"}, template="Q: {question}\nA:", limit=2)
    assert len(custom) == 2 and custom[0].messages[0]["content"] == f"Q: {rows[0]['question']}\nA:"
    assert custom[0].info == {"question": rows[0]["question"], "solution": rows[0]["answer"]}
    assert FIELD_PRESETS["gsm8k"]["prompt"] == "question"
    # an unmapped `answer` column is the label: the marker applies to it too (the whole worked
    # solution was the label, and every episode scored 0)
    for kw in ({"fields": {"prompt": "question", "final_answer": "####"}}, {"template": "{question}", "fields": {"final_answer": "####"}}):
        implicit = load_tasks(jsonl, limit=2, **kw)
        assert [t.label for t in implicit] == [final_answer(r["answer"]) for r in rows[:2]], kw


def test_field_mapping_errors_name_what_is_wrong(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"q": "?", "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl\[0\]: no column\(s\) \['question'\] .* has \['answer', 'q'\]"):
        load_tasks(path, fields="gsm8k")
    with pytest.raises(ValueError, match=r"bad.jsonl\[0\]: no '####' final answer in '4'"):
        load_tasks(path, fields={"prompt": "q", "label": "answer", "final_answer": "####"})
    # a final answer as people write one is its number; one that is no number is refused by row (every
    # episode of its task failed: the reward's float(label) raised)
    path.write_text("".join(json.dumps({"q": "?", "answer": f"... #### {a}"}) + "\n" for a in ("$18", "5\n\nNote", "\u22123")))
    assert [t.label for t in load_tasks(path, fields={"prompt": "q", "label": "answer", "final_answer": "####"})] == \
        ["18", "5", "-3"]
    path.write_text(json.dumps({"q": "?", "answer": "#### 3/4"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl\[0\]: the final answer after '####' is not a number: '3/4'"):
        load_tasks(path, fields={"prompt": "q", "label": "answer", "final_answer": "####"})
    # a decimal comma (a translated set's "#### 2,50") had every comma stripped: the label 250, a right
    # answer 0, a wrong one paid; commas count only as thousands groups, as the graders read them
    for decimal in ("2,50", "\u20ac18,50", "1,2,3"):
        path.write_text(json.dumps({"q": "?", "answer": f"#### {decimal}"}) + "\n")
        with pytest.raises(ValueError, match=r"bad.jsonl\[0\]: .* not a number \(commas only as thousands groups"):
            load_tasks(path, fields={"prompt": "q", "label": "answer", "final_answer": "####"})
    assert final_answer("#### 1,234.5") == "1234.5" and final_answer("#### -12,000") == "-12000"
    assert float(final_answer("#### 1,234.")) == 1234  # (a full stop after it, as before)
    with pytest.raises(ValueError, match="unknown field preset 'gsm'"):
        load_tasks(path, fields="gsm")
    with pytest.raises(ValueError, match=r"\['question'\] are not task fields"):
        load_tasks(path, fields={"question": "q"})
    (tmp_path / "x.txt").write_text("{}")
    with pytest.raises(ValueError, match="unsupported data file"):
        load_records(tmp_path / "x.txt")
    # a template's literal braces, positional fields or a torn field are named by row (an IndexError or a
    # bare "expected '}'" escaped, naming neither; a literal brace read as a missing column)
    path.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    for template in ('Reply as {"answer": n}. {question}', "{question} {0}", "{question"):
        with pytest.raises(ValueError, match=r"bad.jsonl\[0\]: template .*literal brace is written \{\{ or \}\}"):
            load_tasks(path, fields="gsm8k", template=template)
    assert load_tasks(path, fields="gsm8k", template='Reply as {{"answer": n}}. {question}')[0].messages[0]["content"] == \
        'Reply as {"answer": n}. 2+2?'
    # a negative limit dropped the last rows, silently; a split of a plain file was ignored (the
    # "test" split read the training file)
    with pytest.raises(ValueError, match="limit must be a whole number >= 0"):
        load_tasks(path, fields="gsm8k", limit=-1)
    with pytest.raises(ValueError, match="is one file, without splits: split='test'"):
        load_tasks(path, fields="gsm8k", split="test")
    # a CSV row with more cells than the header (an unquoted "1,000") or fewer: the prompt was cut, the
    # label shifted, a task left without its label
    bad_csv = tmp_path / "bad.csv"
    for body in ("What is 2+2?,4\nWhat is 1,000 + 2?,1002\n", "What is 2+2?,4\nWhat is 3+3\n"):
        bad_csv.write_text("prompt,label\n" + body)
        with pytest.raises(ValueError, match=r"bad.csv:3: [13] cell\(s\) for the header's 2 columns"):
            load_tasks(bad_csv)


def test_seeded_shuffle_per_epoch_and_positions():
    ds = TaskDataset.from_file(TRAIN, fields="gsm8k", seed=7)
    n = len(ds)
    ids = [t.id for t in ds.take(0, 3 * n)]
    epochs = [ids[e * n:(e + 1) * n] for e in range(3)]
    # each epoch serves every task exactly once, in its own order, the same for the same seed
    assert all(sorted(e) == sorted(t.id for t in ds.tasks) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != [t.id for t in ds.tasks]
    assert [t.id for t in TaskDataset.from_file(TRAIN, fields="gsm8k", seed=7).take(0, 3 * n)] == ids
    assert [t.id for t in TaskDataset.from_file(TRAIN, fields="gsm8k", seed=8).take(0, n)] != epochs[0]
    # take(position, k) is a pure function: a run resumed at position p draws what it would have
    for p, k in ((0, 5), (n - 2, 5), (2 * n + 3, 4)):
        assert [t.id for t in ds.take(p, k)] == ids[p:p + k]
    assert ds.epoch(n - 1) == 0 and ds.epoch(n) == 1
    assert [t.id for t in ds(4, 3)] == ids[3:7]  # the plain source(n, seed) contract: the seed is the position
    # wrapped in a plain source (a lambda, a mix, a filter), the loop's draws of an epoch serve each task
    # once: positions n times too far apart (seed read as a step) drew 84 of 128 tasks, one 4 times
    from workbench.loop import draw_tasks

    wrapped, drawn, position = (lambda k, seed: ds(k, seed)), [], 0
    for _ in range(n // 4):
        got, position = draw_tasks(wrapped, 4, position, 4)
        drawn += [t.id for _, t in got]
    assert drawn == ids[:n]
    plain = TaskDataset(ds.tasks, shuffle=False)
    assert [t.id for t in plain.take(n - 1, 2)] == [ds.tasks[-1].id, ds.tasks[0].id]


def test_task_records_keep_what_they_say():
    """TRL's conversational format (a list `prompt`) is the chat messages: str() of it trained on
    its Python repr in the user turn. A label beside an answer leaves the answer in info (the
    default of pop("label", pop("answer")) ran first and dropped it); a null id is no id (it was
    the id 'None' for every such task); a prompt of another type is an error naming it."""
    from workbench.agents import AgentContext
    from workbench.data import task_from_record

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    t = task_from_record({"prompt": chat, "label": 5, "answer": "five", "id": None})
    assert t.messages == chat and t.label == 5 and t.info == {"answer": "five"} and t.id != "None"
    # a list's task without an id is known by its place, the same in every process (resumes included)
    from workbench.data import tasks_from_list

    assert [t.id for t in tasks_from_list([{"prompt": "a"}, {"prompt": "b", "id": "x"}, {"prompt": "c", "id": ""}])] == \
        ["item-0", "x", "item-2"]
    t = task_from_record({"prompt": [{"role": "user", "content": "Hi"}], "system": "S"})
    assert t.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    # a system column beside a messages column is the system message (it was left in info, unseen)
    t = task_from_record({"messages": [{"role": "user", "content": "Hi"}], "system": "S"})
    assert t.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}] and t.info == {}
    for key in ("messages", "prompt"):
        with pytest.raises(ValueError, match=f"a 'system' field and another system message in '{key}'"):
            task_from_record({key: chat, "system": "S"})
        assert task_from_record({key: chat, "system": "Be brief."}).messages == chat  # the same one: it
    for empty in (None, "", " "):  # a nullable column's empty cell is no system message (it was 'None')
        assert task_from_record({"messages": chat[1:], "system": empty}).messages == chat[1:]
        assert task_from_record({"prompt": "What is 2+3?", "system": empty}).messages == chat[1:]
    assert task_from_record({"prompt": 7, "answer": 3}).messages == [{"role": "user", "content": "7"}]
    with pytest.raises(ValueError, match="'prompt' must be a string or a list of chat messages, got dict"):
        task_from_record({"prompt": {"text": "hi"}})
    with pytest.raises(ValueError, match="a list 'prompt' must be chat messages"):
        task_from_record({"prompt": ["hi"]})
    # each episode's ctx.tools is its own: the group's episodes share one Task
    task = task_from_record({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]})
    a, b = (AgentContext(base_url="", anthropic_base_url="", side_base_url="", side_anthropic_base_url="", api_key="",
                         model="m", task=task, episode_id=str(i), group_id="g") for i in range(2))
    a.tools.append({"type": "function", "function": {"name": "g"}})
    tools = a.tools
    tools[0]["function"]["name"] = "changed"
    assert b.tools == [{"type": "function", "function": {"name": "f"}}] == task.tools
    assert a.tools is tools and len(a.tools) == 2  # within its episode, the agent's changes stay


def test_files_as_their_writers_write_them(tmp_path):
    """JSON Lines ends a line at "\\n" only: json.dumps(ensure_ascii=False) leaves U+2028 raw in a
    string, where str.splitlines broke the line ("Unterminated string"); a .json file may hold one
    array of records; Excel's CSV UTF-8 starts with a byte-order mark (it named the first column
    '\\ufeffprompt')."""
    rows = [{"prompt": "first line\u2028second\x85third", "label": "1"}, {"prompt": "b", "label": "2"}]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert load_records(jsonl) == rows
    array = tmp_path / "t.json"
    array.write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    assert load_records(array) == rows
    array.write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(ValueError, match=r"t.json:2: not valid JSON"):
        load_records(array)
    csv_file = tmp_path / "t.csv"
    csv_file.write_bytes("prompt,label\r\nwhat is 2+2?,4\r\n".encode("utf-8-sig"))
    assert load_records(csv_file) == [{"prompt": "what is 2+2?", "label": "4"}]
    # an empty id cell is no id: the row's place names the task (a random id changed at every resume)
    csv_file.write_text("id,prompt,label\n,a,1\nq7,b,2\n")
    assert [t.id for t in load_tasks(csv_file)] == ["t:0", "q7"]
    # an empty prompt (a CSV's empty cell, a row of empty cells a spreadsheet left) was a task, trained on
    csv_file.write_text("prompt,label\na,1\n,\n")
    with pytest.raises(ValueError, match=r"t.csv\[1\]: 'prompt' is empty"):
        load_tasks(csv_file)
    # a cell past the csv module's 128 KiB default loads (it failed with an error naming no file)
    csv_file.write_text("prompt,label\n" + "x" * 200_000 + ",1\n")
    assert len(load_tasks(csv_file)[0].messages[0]["content"]) == 200_000
    # a template over a null column writes "" (as the CSV's empty cell), not "None", into the prompt
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"context": None, "q": "Q2", "label": "1"}]), tmp_path / "t.parquet")
    assert load_tasks(tmp_path / "t.parquet", template="Context: {context}\nQuestion: {q}")[0].messages[0]["content"] == \
        "Context: \nQuestion: Q2"


def test_held_out_tasks_and_prompt_columns(tmp_path):
    """A `datasets` directory of train and test splits given as eval_tasks was read as its "train"
    split: the held-out pass@k ran on the training problems. A column named `messages` beside a
    field mapping (an SFT mirror of GSM8K: the worked answer in its assistant turn) took over
    the prompt from fields="gsm8k" and its template: the solution was in the prompt."""
    import datasets

    from workbench.session import ConfigError, _eval_tasks

    def rows(kind: str, n: int) -> list[dict]:
        return [{"question": f"{kind} q{i}", "answer": f"#### {i}"} for i in range(n)]

    two = tmp_path / "two"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows("train", 4)),
                          "test": datasets.Dataset.from_list(rows("test", 2))}).save_to_disk(str(two))
    assert [t.messages[0]["content"] for t in _eval_tasks({"path": str(two), "fields": "gsm8k"})] == ["test q0", "test q1"]
    # a held-out list's tasks are not named as a training list's are (both item-0, item-1, ...)
    assert [t.id for t in _eval_tasks([{"prompt": "a"}, {"prompt": "b"}])] == ["eval-item-0", "eval-item-1"]
    assert [t.messages[0]["content"] for t in _eval_tasks({"path": str(two), "fields": "gsm8k", "split": "train"})][0] == "train q0"
    three = tmp_path / "three"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows("train", 2)),
                          "validation": datasets.Dataset.from_list(rows("val", 2)),
                          "other": datasets.Dataset.from_list(rows("other", 2))}).save_to_disk(str(three))
    with pytest.raises(ConfigError, match="name the held-out one"):
        _eval_tasks({"path": str(three), "fields": "gsm8k"})
    only_train = tmp_path / "only_train"  # its one split is the training problems: no held-out split by default
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows("train", 2))}).save_to_disk(str(only_train))
    with pytest.raises(ConfigError, match="name the held-out one"):
        _eval_tasks({"path": str(only_train), "fields": "gsm8k"})
    # a saved Dataset (dataset["train"].save_to_disk) has no splits either: "test" read its training rows
    lone = tmp_path / "lone"
    datasets.Dataset.from_list(rows("train", 2)).save_to_disk(str(lone))
    with pytest.raises(ConfigError, match="holds one Dataset, without splits: split='test'"):
        _eval_tasks({"path": str(lone), "fields": "gsm8k", "split": "test"})
    assert len(load_tasks(lone, fields="gsm8k")) == 2  # (training reads it)
    # a TaskDataset's generated ids held out are not a training list's (both item-0)
    assert [t.id for t in _eval_tasks(TaskDataset([{"prompt": "a"}, {"prompt": "b", "id": "q9"}]))] == ["eval-item-0", "q9"]
    one_file = tmp_path / "gsm.jsonl"
    one_file.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    with pytest.raises(ConfigError, match="is one file, without splits"):
        _eval_tasks({"path": str(one_file), "fields": "gsm8k", "split": "test"})
    # training reads "train" as before
    assert [t.messages[0]["content"] for t in TaskDataset.from_file(two, fields="gsm8k", shuffle=False).tasks][0] == "train q0"
    # ... and a split's tasks are named with it: train and test were both two:0, two:1, ...
    assert [t.id for t in load_tasks(two, fields="gsm8k", split="test")] == ["two/test:0", "two/test:1"]
    assert load_tasks(two, fields="gsm8k")[0].id == "two/train:0"

    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7",
                               "messages": [{"role": "user", "content": "Tom?"},
                                            {"role": "assistant", "content": "3 + 4 = 7\n#### 7"}]}) + "\n")
    for kwargs in ({"fields": "gsm8k"}, {"fields": {"label": "answer", "final_answer": "####"}, "template": "Q: {question}"}):
        t = load_tasks(sft, **kwargs)[0]
        assert [m["role"] for m in t.messages] == ["user"] and "7" not in t.messages[0]["content"], kwargs
        assert t.label == "7" and t.info["messages"][1]["role"] == "assistant"
    # no mapping: the columns are the fields, and the messages end with the worked answer: the policy
    # was shown the answer it is rewarded for (every reward and pass@k inflated, silently). Refused
    with pytest.raises(ValueError, match=r"sft.jsonl\[0\]: the task's messages end with an assistant turn \('3 \+ 4 = 7"):
        load_tasks(sft)
    sft.write_text(json.dumps({"prompt": "Tom?", "messages": [{"role": "user", "content": "Tom?"},
                                                            {"role": "assistant", "content": "#### 7"}]}) + "\n")
    with pytest.raises(ValueError, match=r"has a 'prompt' column too: map it, fields=\{'prompt': 'prompt'\}"):
        load_tasks(sft)
    assert load_tasks(sft, fields={"prompt": "prompt"})[0].messages == [{"role": "user", "content": "Tom?"}]


def test_tools_in_columnar_files_and_as_json_text(tmp_path):
    """Parquet stores nested records as one struct type over all rows: each row read back held every
    key any row has, as None (a tool's schema listed the other tools' parameters as null, rendered into
    the prompt; a message's `name` None). Tools as JSON text (a CSV cell, the usual function-calling
    layout) stayed a string the template walked character by character: every episode failed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def tool(name, param):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}

    rows = [{"messages": [{"role": "user", "content": "Weather in Oslo?", "name": "ann"}], "tools": [tool("get_weather", "city")]},
            {"messages": [{"role": "user", "content": "Add 2."}], "tools": [tool("add", "a")]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "tools.parquet")
    tasks = load_tasks(tmp_path / "tools.parquet")
    assert [t.tools for t in tasks] == [r["tools"] for r in rows] and [t.messages for t in tasks] == [r["messages"] for r in rows]
    # the same through a field mapping (the nulls were dropped only in columns named like task fields)
    pq.write_table(pa.Table.from_pylist([{"q": r["messages"][0]["content"], "functions": r["tools"]} for r in rows]),
                   tmp_path / "mapped.parquet")
    assert [t.tools for t in load_tasks(tmp_path / "mapped.parquet", fields={"prompt": "q", "tools": "functions"})] == \
        [r["tools"] for r in rows]
    csv_file = tmp_path / "tools.csv"
    with open(csv_file, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "tools"])
        w.writerow(["Weather in Oslo?", json.dumps([tool("get_weather", "city")])])
        w.writerow(["No tools.", ""])
    assert [t.tools for t in load_tasks(csv_file)] == [[tool("get_weather", "city")], None]
    with pytest.raises(ValueError, match="'tools' is text but not JSON"):
        task_from_record({"prompt": "x", "tools": "[{oops"})
    with pytest.raises(ValueError, match="'tools' must be a list of tool schemas"):
        task_from_record({"prompt": "x", "tools": {"type": "function"}})
    # chat messages as JSON text too (TRL's conversational prompt exported to CSV): one user turn of
    # raw JSON before, the system message inside it; a prompt that only looks like JSON stays text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    with open(csv_file, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "label"])
        w.writerow([json.dumps(chat), "4"])
        w.writerow(["[1, 2] - which is larger?", "2"])
    assert [t.messages for t in load_tasks(csv_file)] == [chat, [{"role": "user", "content": "[1, 2] - which is larger?"}]]
    assert task_from_record({"messages": json.dumps(chat)}).messages == chat


def test_the_sessions_seed_picks_the_agent_files_tasks():
    """The agent file's tasks(n, seed) got the data position as its seed whatever the session's
    seed: every seed of a sweep drew the same tasks (a data file's shuffle did follow it). Mixed
    in now, positional still, and seed 0 draws what it always drew."""
    from workbench.agents import load_agent
    from workbench.examples.arithmetic_env import tasks
    from workbench.session import DEFAULT_AGENT, _task_source

    spec = load_agent(DEFAULT_AGENT)
    prompts = {seed: [t.messages[-1]["content"] for t in _task_source(None, spec, seed)(16, 32)] for seed in (0, 1, 2)}
    assert prompts[0] == [t.messages[-1]["content"] for t in tasks(16, 32)]
    assert prompts[0] != prompts[1] != prompts[2] != prompts[0]
    again = _task_source(None, spec, 1)
    assert [t.messages[-1]["content"] for t in again(16, 32)] == prompts[1]  # a function of (seed, position)
    # records (dicts) an agent file's tasks() returns are made Tasks, as a tasks= list's are (they went on
    # as they were: every episode failed on task.id and the dead group's record ended the run)
    import types

    from workbench.agents import Task

    records = types.SimpleNamespace(path="x.py", tasks=lambda n, s: [{"messages": [{"role": "user", "content": "2+5?"}],
                                                                      "label": 7} for _ in range(n)])
    for seed in (0, 3):
        made = _task_source(None, records, seed)(2, 5)
        assert all(isinstance(t, Task) and t.label == 7 for t in made) and len({t.id for t in made}) == 2
    with pytest.raises(ValueError, match=r"tasks\(1, 0\)\[0\]: a task must be an object"):
        _task_source(None, types.SimpleNamespace(path="x.py", tasks=lambda n, s: ["2+5?"]), 0)(1, 0)


def test_interactive_rollouts_draw_each_task_of_a_dataset_once():
    """wb.rollout's draws advanced the cursor before drawing: a smaller draw after a larger one
    re-served a task and skipped another (groups(4) served q652-q655, then episode() q653)."""
    import types

    from workbench.agents import Task
    from workbench.session import RolloutHandle

    ds = TaskDataset([Task([{"role": "user", "content": f"q{i}"}], id=f"q{i}") for i in range(1000)], shuffle=False)
    handle = RolloutHandle(types.SimpleNamespace(task_source=ds))
    drawn = [t.id for n in (4, 1, 4, 2) for t in handle._tasks(n)]
    assert len(drawn) == 11 and len(set(drawn)) == 11
    assert [int(i[1:]) for i in drawn] == list(range(int(drawn[0][1:]), int(drawn[0][1:]) + 11))


def test_interactive_rollouts_keep_their_newest_trajectories_only():
    """wb.rollout kept every trajectory it ran for the session's life: a hand-written loop of
    groups and steps grew it without end (an MoE segment's recorded experts each)."""
    import types

    from workbench.session import RolloutHandle

    handle = RolloutHandle(types.SimpleNamespace(task_source=None))
    handle.keep = 5
    for k in range(4):
        handle._kept([f"t{k}a", f"t{k}b"])
    assert handle.trajectories == ["t1b", "t2a", "t2b", "t3a", "t3b"] and handle.last == "t3b"
