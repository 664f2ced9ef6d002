"""Final-answer extraction and normalisation for math responses (pure string functions).

Formats our recipes use:
- DAPO: the last line reads `Answer: <answer>` (docs/algorithms.md §2; the DAPO prompt wrapper asks
  for it). We take the last `Answer:` in the response, up to the end of its line.
- `\\boxed{...}` / `\\fbox{...}` with nested braces (also `\\boxed 5`), the last one.
Whichever marker comes last in the response wins; an `Answer:` line holding a `\\boxed{}` is
unwrapped.

`normalize` rewrites an answer into a canonical string without changing its meaning, so that
string equality of two normalised answers implies equivalence. It never decides inequality;
that is math-verify's job.
"""

from __future__ import annotations

import re

_ANSWER_RE = re.compile(r"(?i)\banswer\s*:")
_BOX_CMDS = ("\\boxed", "\\fbox")
MAX_ANSWER_CHARS = 1000


def _brace_group(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[start] == '{', and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "\\":  # skip escaped characters such as \{ and \}
            continue
        if c == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif c == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def last_boxed(text: str) -> tuple[int, str] | None:
    """(position, content) of the last well-formed `\\boxed{..}`/`\\fbox{..}`/`\\boxed x`."""
    pos = max(text.rfind(cmd) for cmd in _BOX_CMDS)
    while pos >= 0:
        cmd = next(c for c in _BOX_CMDS if text.startswith(c, pos))
        j = pos + len(cmd)
        if j < len(text) and text[j] == "{":
            group = _brace_group(text, j)
            if group is not None:
                return pos, group[0]
        elif j < len(text) and text[j] == " ":
            m = re.match(r" +([^\s$]+)", text[j:])
            if m:
                return pos, m.group(1)
        pos = max(text.rfind(c, 0, pos) for c in _BOX_CMDS)
    return None


def _unwrap_boxed(s: str) -> str:
    found = last_boxed(s)
    return found[1] if found is not None else s


def extract_answer(response: str) -> str | None:
    """The final answer of a response, or None when it has neither marker."""
    answer_pos, answer = -1, None
    for m in _ANSWER_RE.finditer(response):
        line = response[m.end() :].split("\n", 1)[0].strip()
        if line.strip("*$ ."):
            answer_pos, answer = m.start(), line
    boxed = last_boxed(response)
    if boxed is not None and boxed[0] > answer_pos:
        answer = boxed[1]
    elif answer is not None:
        answer = _unwrap_boxed(answer)
    if answer is None:
        return None
    answer = answer.strip().strip("*").strip()
    return answer[:MAX_ANSWER_CHARS] or None


# --- normalisation -------------------------------------------------------------------------

_UNITS = (
    "cm mm km m2 cm2 meters metres meter centimeters centimeter millimeters kilometers inch "
    "inches ft feet foot yards yard miles mile mph kmh units unit degrees degree dollars dollar "
    "cents cent hours hour hrs minutes minute mins seconds second secs sec days day weeks week "
    "months years year pounds pound lbs ounces ounce oz kg grams gram liters litres liter ml "
    "gallons gallon square sq cubic calories points people students"
).split()
_UNIT_WORDS = "|".join(sorted(_UNITS, key=len, reverse=True))
_TEXT_CMD = r"\\(?:text|textrm|textbf|mbox|mathrm|mathbf|textit)"
_TRAILING_TEXT_UNIT = re.compile(
    rf"(?<=[\d}}\s.])\s*{_TEXT_CMD}\{{\s*[A-Za-z][A-Za-z\s.]*\}}(?:\^\{{?\d\}}?)?\s*$"
)
_TRAILING_WORD_UNIT = re.compile(
    rf"(?<=[\d}}])\s*(?:(?:square|sq\.?|cubic)\s+)?(?:{_UNIT_WORDS})\.?(?:\^\{{?\d\}}?)?\s*$",
    re.IGNORECASE,
)
_NUMBER_THEN_WORDS = re.compile(  # "5 apples", "12 red marbles": a number followed by plain words
    r"^([+-]?\d[\d,]*(?:\.\d+)?)\s+(?!(?:sin|cos|tan|cot|sec|csc|log|ln|exp|sqrt|pi)\b)"
    r"[a-z]{3,}(?:\s+[a-z]+)*$"
)
_LEADING_PHRASE = re.compile(r"(?i)^(?:the\s+)?(?:final\s+)?answer\s*(?:is\s*:?|:)\s*")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\s*(?:=|\\in)\s*(?=\S)")
_SPACING_CMDS = re.compile(r"(?<!\\)\\[!,;: ]|\\q?quad\b")  # not the \\ row separator
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+$")


def _collapse_spaces(s: str) -> str:
    """Drop whitespace except between two letters, where it can separate a LaTeX command from
    a variable (`\\pi r`)."""
    return re.sub(
        r"\s+",
        lambda m: " "
        if 0 < m.start() and m.end() < len(s) and s[m.start() - 1].isalpha() and s[m.end()].isalpha()
        else "",
        s,
    )


def normalize(answer: str) -> str:
    """Canonical form of an answer string (meaning-preserving rewrites only)."""
    s = _unwrap_boxed(answer.strip())
    s = _LEADING_PHRASE.sub("", s)
    s = s.replace("\\$", "").replace("$", "")
    for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(opener) and s.endswith(closer):
            s = s[len(opener) : -len(closer)]
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left\b|\\right\b|\\big\b|\\Big\b", "", s)
    s = _SPACING_CMDS.sub(" ", s).replace("~", " ")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°|\\circ\b|\\degree\b", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    for pattern in (_TRAILING_TEXT_UNIT, _TRAILING_WORD_UNIT):
        s = pattern.sub("", s).strip()
    s = _NUMBER_THEN_WORDS.sub(r"\1", s)
    s = re.sub(rf"{_TEXT_CMD}\{{([^{{}}]*)\}}", r"\1", s)
    s = _ASSIGNMENT.sub("", s)
    s = _collapse_spaces(s.strip())
    m = re.fullmatch(r"\(?([A-E])\)?", s)
    if m:  # multiple-choice letter: "(C)" == "C"
        s = m.group(1)
    return s


def as_integer(s: str) -> int | None:
    """The integer a normalised answer denotes, if it is a plain integer (commas as thousands
    separators allowed), else None."""
    if len(s) > 200:
        return None
    if re.fullmatch(r"[+-]?\d+", s):
        return int(s)
    if _THOUSANDS.fullmatch(s):
        return int(s.replace(",", ""))
    return None
