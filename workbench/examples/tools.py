"""Helpers shared by the example agents."""

from __future__ import annotations

import ast
import math
import numbers
import operator
import random
import re

from ..agents import Task
from ..toy.tasks import CALC_TOOL, TOOL_SYSTEM_PROMPT, arithmetic_problem

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calc(expression: str) -> str:
    """Evaluate + - * on integers, nothing else (the calculator tool; never eval())."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")

    expression = str(expression)
    if len(expression) > MAX_EXPRESSION_CHARS:  # the policy writes it: "-" * 6000 + "1" raised MemoryError in the parser
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        return str(ev(ast.parse(expression, mode="eval")))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "error: unsupported expression"


MAX_EXPRESSION_CHARS = 256
MAX_ANSWER_DIGITS = 30  # int() refuses over 4300 digits (a ValueError failed, so dropped, the episode)


# a number as a model writes one: thousands separated by commas (9,801), a decimal part (12.0); a
# minus only where no word or digit comes before it ("2-3 days" is 2 and 3, not 2 and -3)
# (not an exponent's digits: "The result is 1.665e3" read 3)
# (nor a decimal part alone: "The answer is .5" read 5, paid for a label 5)
_NUMBER = re.compile(r"(?:(?<![\w.-])-)?(?<!\d[eE])(?<!\d[eE][-+])(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# where a reply says which number is its answer: the last of these, its first number. A marker's
# text ends at the line's end or the next marker (to the line's end, the first marker hid the later
# ones on its line: "The answer is 71. Wait, the answer is 72." was 71, a correction graded by its
# first guess, which trained against self-correction)
# ("is\b": "the answer isn't 5, it's 6" read 5)
_NEXT = r"(?=\banswer\b[ \t]*(?:is\b|:|=)|####|\\boxed\{|\n|$)"
# ("####" only where a number is all the rest of its line, as GSM8K writes its final answer: a markdown
# heading "#### Step 2: Verify" or "#### 2. Check" was the answer 2, a right answer beside it scored 0)
# ("#### 72." too: its full stop made it no marker, and a guess in prose before it was the answer)
_MARKED = re.compile(rf"\\boxed\{{((?:[^{{}}]|\{{[^{{}}]*\}})*)\}}|####[ \t]*(?=\$?-?\d[\d,]*(?:\.\d+)?\.?[ \t]*(?:\n|$))([^\n]*?){_NEXT}"
                     rf"|\banswer\b[ \t]*(?:is\b|:|=)[ \t]*([^\n]*?){_NEXT}", re.I)
# an unevaluated expression ("37 * 45", "9 x 2", LaTeX's "12 \times 3", "5 \cdot 7", a power "6\u00b2"): a side
# of an equation that is no result
# (no two \s* around an optional character: "\s*[(]?\s*" before text that fails to match tried every
# split of a run of spaces, time the square of its length with the GIL held: a reply of "\boxed{"
# and 255 of Qwen3's 128-space tokens froze the runner, its server and every episode's timeout 11 s)
# (and in words: "8 times 9, which equals 72" is 72)
_EXPRESSION = re.compile(r"\s*(?:[$(\[]\s*)?-?\d[\d,.]*\s*(?:(?:\*\*|[-+*/\u00d7\u00f7^\u00b7\u22c5]|\\times|\\cdot|\\div|x(?=\s*\d)"
                         r"|(?:times|plus|minus|multiplied\s+by|divided\s+by)(?=\s+\d))"
                         r"\s*(?:[(\[{]\s*)?-?\d|[\u00b2\u00b3\u00b9\u2070\u2074-\u2079])")
# dashes a model writes as a minus (en dash, figure dash, hyphens, full-width and small hyphen-minus):
# "The answer is \u201348" read 48, paying a wrong sign (em dash: punctuation, left alone)
_MINUS = str.maketrans({c: "-" for c in "\u2212\u2010\u2011\u2012\u2013\ufe63\uff0d"})
_INVISIBLE = re.compile("[\u200b-\u200d\u2060\ufeff]")  # ("7\u200b2" read 7)
# what makes a marked sentence no one answer: a negation before its number ("the answer is not 1665;
# it is 1664" paid 1665), or a hedge or a correction joining two numbers ("18 or 19", "1665, no wait,
# 1664": the first guess was paid, a right correction scored 0). Only there: "18, not 20", "3 hours, or
# 180 minutes" and "the mean is 85" are one answer each
_NEGATED = re.compile(r"\s*(?:not|isn't|never)\b", re.I)
# (possessive, and from a number's first digit only: "\s*,?\s*" tried every split of a run of spaces,
# "The answer is 5" and 16,000 spaces took 11 s with the GIL held, as _EXPRESSION's note above)
# Also a list or a range of numbers ("72, 73, 74", "72 and 73", "70 to 75") and a hedge in brackets or with a
# softener ("72 (or 73)", "72 or possibly 73"): each paid its first number
# ("72 | 73", "72 vs 73", "72 ± 1", "72 through 75", "71 (alternatively 72)", "71 \text{ or } 72": each paid its first)
_HEDGED = re.compile(r"(?<![\d,.])-?\d[\d,.]*+(?:\s*+[,(]?\s*+(?:or|maybe|possibly|perhaps|alternatively|no,?\s*wait|wait|actually|sorry|I mean)\b"
                     r"[\s,:]*+(?:(?:possibly|maybe|perhaps)\s++)?|(?<=,)\s++|\s++(?:to|and|through|thru|vs\.?|versus)\s++"
                     r"|\s*+(?:\||±|\+/-|\\pm|\\text\{\s*or\s*\})\s*+)-?\d", re.I)


# "which is", "so", "gives", "i.e." or an arrow before a number: an unevaluated expression's "=" (answer_text)
_RESULT_LINK = re.compile(r"\b(?:(?:which|that)\s++is|so|gives|giving)\b(?=\s*+-?\$?\d)|\bi\.e\.,?(?=\s*+-?\$?\d)"
                          r"|(?:\u2192|->|=>)(?=\s*+-?\$?\d)", re.I)
# nothing but numbers, operators and brackets (an operator in words too): what comes before such a link
_OPERAND = r"[\s\d.,+\-*/^()\[\]{}$\u00d7\u00f7\u00b7\u22c5\u00b2\u00b3]*"
_ONLY_EXPRESSION = re.compile(rf"{_OPERAND}(?:(?:\\times|\\cdot|\\div|x|times|plus|minus|multiplied\s+by|divided\s+by){_OPERAND})*",
                              re.I)
_CHECKING = re.compile(r"\b(?:check|verify|double-check|confirm)", re.I)
_CHECK_ARITHMETIC = re.compile(r"\d\s*[-+*/\u00d7\u00f7x]\s*\d")  # "72 - 67 = 5": the check's working


def _hedged(span: str) -> bool:
    """Whether a marked sentence gives more than one answer: a hedge between two different numbers
    ("72 or 73"; "72, or 72 apples in total" restates one), or a range ("between 70 and 75")."""
    if re.match(r"[^\d]*?\bbetween\b", span, re.I) and len(_NUMBER.findall(span)) > 1:
        return True
    for h in _HEDGED.finditer(span):
        pair = [n.replace(",", "") for n in _NUMBER.findall(span[h.start(): h.end() + 40])[:2]]
        if len(pair) < 2 or pair[0] != pair[1]:
            return True
    return False


def _first_marked(marked: list) -> dict[str, int]:
    """Each number a marked sentence holds -> the first marker's place that holds it (one pass:
    compared marker by marker, many checks on one line were quadratic)."""
    first: dict[str, int] = {}
    for k, e in enumerate(marked):
        sentence = re.split(r"\.(?:\s|$)|;", next(g for g in e.groups() if g is not None)[:200], maxsplit=1)[0]
        for n in _NUMBER.finditer(sentence):
            first.setdefault(_rounded(n.group()), k)
    return first


def _rounded(number: str) -> int | str:
    """A written number as the whole number nearest it: a check's "100 / 3 = 33.33" holds the 33 it
    checks (one past a float's range as written)."""
    try:
        return round(float(number.replace(",", "")))
    except OverflowError:
        return number


def answer_text(text: str | None) -> str | None:
    """The number a reply gives as its answer, as written without thousands separators; None when
    it gives none. Its last marked answer (\\boxed{...}, "#### ...", "answer is ..." / "Answer: ...")
    up to the sentence's end, the number after its last "=" ("The answer is 48 + 24 = 72."), else
    its first ("Answer: 18 (9 x 2)"); with no marker, the reply's last number. Read by the last
    number, "The answer is 18. Check: 20 - 2 = 18 and 18 / 2 = 9" was 9 and "Answer: 18 (9 x 2)" 2.
    No whole number where the answer is a fraction or a power ("\\frac{1}{2}", "3/4", "1e5",
    "2^{10}" with nothing after it). LaTeX separators ("1{,}234", "1\\,234") and thin spaces are
    thousands separators; an exponent after a unit ("18 m^2") is no number; a unicode minus is a
    minus ("-12" read 12). Of an equation the last side that is not an unevaluated expression
    ("Answer: 18 = 9 * 2" is 18: it read 9); a marked expression with no result is no answer
    ("The answer is 1665. Note: answer = 37*45" read 37). A marker in a check of the answer ("To
    verify the answer: 72 - 67 = 5") is skipped where its arithmetic holds an earlier marked number
    (or no marker comes before it; else it is a correction worked out); where no marked sentence
    holds a number ("Answer: Let's think step by step."), the reply's last number; "which equals"
    is an "=", and after an unevaluated expression "which is", "so", "i.e." and an arrow too; a
    marked "not 6" rules out 6 (an earlier marked 6 is no answer), not an earlier answer; two
    different numbers hedged ("72 (or 73)"), listed ("72, 73") or as a range ("70 to 75") are no
    one answer."""
    # a minus apart from its number ("\u2212 5") or before a currency sign ("-$5"): the sign was lost
    # (the minus sign alone: an en dash with spaces is punctuation, "Final answer \u2013 72" is 72)
    text = re.sub(r"(?<![\w.-])-\$(?=\d)", "$-", re.sub("\u2212\\s+(?=\\d)", "\u2212", text or ""))
    text = _INVISIBLE.sub("", text.translate(_MINUS)).replace("{,}", ",")
    text = re.sub(r"(?<=\d)(?:\\,|[\u2009\u202f\u00a0])(?=\d{3}(?!\d))", ",", text)
    text = re.sub(r"(?<=[A-Za-z])(?:\^\{?\d+\}?|[\u00b2\u00b3])", "", text)
    # markdown around a marker: "**Final Answer**: 18", "__Answer__ = 18" were no markers, and the last
    # number (a check's, "18 / 2 = 9") was read; a heading "### Final Answer" gives the next line's number
    text = re.sub(r"(?<=[A-Za-z])(?:\*\*|__)|(?:\*\*|__)(?=[A-Za-z])", "", text)
    text = re.sub(r"(?im)^[ \t]*#{1,6}[ \t]*((?:final[ \t]+)?answer)[ \t]*:?[ \t]*$", r"\1:", text)
    marked = list(_MARKED.finditer(text))
    found: list = []
    numbered = False  # whether a marked sentence holds a number at all
    negated: set = set()  # numbers a later marked sentence said the answer is not
    first_marked = None  # _first_marked, made at the first check
    # the last marker that gives a number: "\boxed{408}. I hope this answer is helpful." is 408 (the
    # last marker, "answer is helpful", read None); one that ends its line with nothing but markup
    # ("**Answer:**\n408", "The answer is:\n408") gives the next line's
    for k in range(len(marked) - 1, -1, -1):
        m = marked[k]
        if m.group(3) is not None:
            # a prose marker in a check of the answer given ("\boxed{72}. To double-check the answer:
            # 72 - 2 = 70") is no answer: read as one (70), checking one's work scored 0. Only a check's
            # arithmetic: "After checking my work, the answer is 72" is a correction, the answer.
            # (The look back is bounded: from each of many markers on one line, quadratic)
            lo = max(0, m.start() - 200)
            start = max(text.rfind("\n", lo, m.start()), text.rfind(". ", lo, m.start()), lo - 1) + 1
            # A check's arithmetic works on the answer it checks ("72 - 2 = 70" holds 72, "72 / 8 = 9" too);
            # one that shows none of an earlier marked number is a correction worked out ("The answer is
            # 4. After double-checking, the answer is 7 - 2 = 5" read the wrong 4)
            if _CHECKING.search(text, start, m.start()) and _CHECK_ARITHMETIC.search(m.group(3)[:200]):
                first_marked = _first_marked(marked) if first_marked is None else first_marked
                if k == 0 or any(first_marked.get(_rounded(n.group()), k) < k for n in _NUMBER.finditer(m.group(3)[:200])):
                    continue
        body = next(g for g in m.groups() if g is not None)
        if not re.search(r"[^\W_]", body) and not m.group().startswith("\\boxed"):
            following = re.match(r"[ \t]*\n\s*([^\n]*)", text[m.end():])
            body = following.group(1) if following else body
        span = re.split(r"(?<!\bi\.e)(?<!\be\.g)\.(?:\s|$)|;", body, maxsplit=1)[0]  # the marked sentence ("i.e." ends none)
        numbered = numbered or bool(re.search(r"\d", span))
        # "which equals 72" is "= 72" ("The answer is 8 times 9, which equals 72" read 8); not "makes" or
        # "gives" ("24 eggs, which makes 2 dozen" is 24)
        # (anchored at the word: a leading ",?\s*" tried every start in a run of spaces, quadratic)
        span = re.sub(r"\b(?:(?:which|that)\s++)?(?:equals|is\s+equal\s+to)\b(?=\s*+-?\$?\d)", "=", span, flags=re.I)
        # an unevaluated expression's result written in words or an arrow: "7 - 2, which is 5", "7 - 2, so 5",
        # "i.e. 5", "7 - 2 → 5" (read None: the right answer scored 0, under a wrong one's partial credit).
        # Only the connector right after a leading expression with no "=" yet: "5 * 3 = 15, which is 3 more
        # than 12" is 15, "4 * 6 = 24 eggs, which gives 2 dozen" 24, "24 eggs, which is 2 dozen" 24
        link = _RESULT_LINK.search(span) if "=" not in span and _EXPRESSION.match(span) else None
        if link is not None and _ONLY_EXPRESSION.fullmatch(span[:link.start()]):
            span = span[:link.start()] + "=" + span[link.end():]
        span = next((side for side in reversed(span.split("=")) if not _EXPRESSION.match(side)), "")
        found = list(_NUMBER.finditer(span))
        if found and _NEGATED.match(span[:found[0].start()]) and not _hedged(span):
            # "the answer is not 6" rules out 6, not an earlier "\boxed{5}" (which read None): an earlier
            # marked answer stands unless it is the number ruled out ("\boxed{13}. The answer is not 13")
            negated.add(found[0].group().replace(",", ""))
            found = []
            continue
        if found and _hedged(span):
            return None
        found = found[:1]
        if found and found[0].group().replace(",", "") in negated:
            return None
        if found:
            break
    if not marked or not found and not numbered:
        # no marker, or none with a number in its sentence ("Answer: Let's think step by step." and
        # the work after it read None, a right answer 0): the reply's last number, unless the text
        # after the last marker hedges ("Answer: I cannot say; maybe 71, maybe 72 (or 73)")
        if marked and _hedged(text[marked[-1].start():]):
            return None
        span = text
        found = list(_NUMBER.finditer(text))[-1:]
    if not found:
        return None
    m = found[0]
    if (re.match(r"\s*(?:/\s*\d|\^|\*\*\s*\d|[eE][-+]?\d)|[\u00b2\u00b3\u00b9\u2070\u2074-\u2079]", span[m.end():])
            or re.search(r"\\[dt]?frac", span[:m.start()])  # (\dfrac{18}{5}, Qwen's and DeepSeek's boxed form, read 18)
            or re.search(r"\d\s*(?:/|\*\*|\^)\s*$", span[:m.start()])):
        return None  # a fraction or a power, not the whole number it starts or ends with ("3/4" read 4, "7\u00b2" 7)
    return m.group().replace(",", "")


def answer_number(text: str | None) -> int | None:
    """The reply's answer (answer_text) as an integer: "9,801" is 9801 and "12.0" is 12 (both read
    801 and 0: right answers scored wrong); None when there is none, it is not a whole number, or
    it has more than MAX_ANSWER_DIGITS digits."""
    found = answer_text(text)
    if found is None:
        return None
    whole, _, fraction = found.partition(".")
    if len(whole.lstrip("-")) > MAX_ANSWER_DIGITS or fraction.strip("0"):
        return None
    return int(whole)


def label_number(label) -> int:
    """A task's label as the whole number it names: an int as it is, text as a data file holds it
    ("18", "9,801": gsm8k's final answers and CSV cells are text, which compared with an int read
    every right answer wrong, or raised where subtracted). ValueError for anything else."""
    if isinstance(label, numbers.Integral) and not isinstance(label, bool):  # (numpy's too: a DataFrame row's)
        return int(label)
    if isinstance(label, numbers.Real) and not isinstance(label, bool) and math.isfinite(label) and float(label).is_integer():
        return int(label)  # (18.0: a pandas int column with a missing value is float)
    number = answer_number(label) if isinstance(label, str) and label.strip() else None
    # (commas only as thousands groups: "1,2,3", "1,5", "12,34" read 3, 5 and 34)
    if number is None or not re.fullmatch(r"\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.0*)?\s*", label):
        raise ValueError(f"the task's label {label!r} is no whole number: these agents grade a number")
    return number


def is_answer(reply: str | None, label) -> bool:
    """Whether the reply's answer (answer_number) is the label's number (label_number)."""
    got = answer_number(reply)
    return got is not None and got == label_number(label)


def tool_tasks(n: int, seed: int = 0) -> list[Task]:
    """'Compute a*b.' tasks with the calc tool; label = the right answer."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = arithmetic_problem(rng, max_operand=99, ops="+-*")
        out.append(Task([{"role": "system", "content": TOOL_SYSTEM_PROMPT},
                         {"role": "user", "content": f"Compute {p.expression}."}], tools=[CALC_TOOL], label=p.answer,
                        id=f"calc-{seed}-{i}"))  # (the seed's and position's: the same task drawn again, the same id)
    return out


# A small local document collection for the search tool: one fact per sentence, each sentence
# a passage. Shipped in code, so every runner (a Ray actor) has the same collection.
DOCUMENTS = {
    "orchard": ["The orchard has 37 apple trees.", "The orchard has 12 pear trees.",
                "A fence of 80 posts surrounds the orchard."],
    "library": ["The library holds 64 shelves of books.", "The reading room of the library seats 23 people."],
    "harbor": ["The harbor shelters 15 fishing boats.", "The lighthouse of the harbor is 41 meters tall."],
    "bakery": ["The bakery sells 58 loaves a day.", "The bakery bakes 26 cakes on Sundays."],
}
# (document, what the question names, its value): the facts document tasks ask about
FACTS = [("orchard", "apple trees in the orchard", 37), ("orchard", "pear trees in the orchard", 12),
         ("library", "shelves of books in the library", 64), ("library", "seats in the reading room of the library", 23),
         ("harbor", "fishing boats in the harbor", 15), ("bakery", "cakes the bakery bakes on Sundays", 26)]
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the local documents; returns the best matching passage.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
SEARCH_SYSTEM_PROMPT = "You are a careful assistant. Use the search tool for documents and the calc tool for arithmetic."
_STOP = {"the", "a", "an", "of", "in", "on", "is", "are", "how", "many", "what", "and", "add", "to", "number",
         "document", "documents", "look", "up", "search"}


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+|\d+", str(text).lower())) - _STOP


def search(query: str) -> str:
    """The document search tool: the passage ("document: sentence") sharing the most words
    with the query (stop words aside; the first on a tie), or "no match"."""
    passages = [f"{doc}: {s}" for doc, sentences in DOCUMENTS.items() for s in sentences]
    words = _words(query)
    score, best = max(((len(words & _words(p)), -i), p) for i, p in enumerate(passages))
    return best if score[0] > 0 else "no match"


def document_tasks(n: int, seed: int = 0) -> list[Task]:
    """Tasks for the calc + search agents, alternating: a document task ('Look up the number of
    pear trees in the orchard and add 7.'; label = the fact's value + 7; info["query"] = the
    question), offered both tools, and a 'Compute a*b.' task (tool_tasks), offered calc alone:
    the toy model was warm-started with calc as its only tool, and a second tool in its prompt
    puts it out of its distribution (it then writes no valid call at all)."""
    rng = random.Random(seed)
    calc_tasks = iter(tool_tasks(n, seed))
    out = []
    for i in range(n):
        if i % 2:
            calc = next(calc_tasks)
            out.append(Task(calc.messages, tools=calc.tools, label=calc.label, id=f"doc-{seed}-{i}"))
            continue
        doc, what, value = rng.choice(FACTS)
        k = rng.randint(1, 9)
        question = f"Look up the number of {what} and add {k}."
        out.append(Task([{"role": "system", "content": SEARCH_SYSTEM_PROMPT}, {"role": "user", "content": question}],
                        tools=[CALC_TOOL, SEARCH_TOOL], label=value + k, info={"query": question, "document": doc},
                        id=f"doc-{seed}-{i}"))  # (the seed's and position's: drawn again, the same id)
    return out
