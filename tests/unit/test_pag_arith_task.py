"""The PAG quickstart task (megarl/tasks/pag_arith.py): its SFT turns, checked by hand."""

import json
import random

import pytest

from megarl.rollout.multi_turn import VERDICT_CORRECT, VERDICT_WRONG, parse_verdict
from megarl.tasks import pag_arith as P
from megarl.tasks.arith import cot_lines, cot_response
from megarl.data.templates import apply_template
from megarl.tasks.tiny_model import EOS_TOKEN


def test_a_wrong_step_is_one_column_off_and_followed_consistently():
    # 347 + 856: the tens column (4+5+1=10) written as 9 -> carry 0 -> 3+8+0=11 -> 1193
    assert cot_lines(347, 856, wrong_column=1, delta=-1) == (["7+6+0=13 3", "4+5+1=9 93", "3+8+0=11 1193"], 1193)
    assert cot_lines(347, 856) == (["7+6+0=13 3", "4+5+1=10 03", "3+8+1=12 1203"], 1203)
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        text, answer = P.wrong_solution(a, b, rng)
        assert answer != a + b and text.endswith(f"Answer: {answer}")
        right = cot_lines(a, b)[0]
        wrong = text.split("\n")[:-1]
        first = next(i for i, (x, y) in enumerate(zip(right, wrong)) if x != y)
        assert right[first].split("=")[0] == wrong[first].split("=")[0]  # same digits and carry in
        assert abs(int(right[first].split("=")[1].split()[0]) - int(wrong[first].split("=")[1].split()[0])) == 1


def test_verification_checks_each_column_sum_and_stops_at_the_first_wrong_one():
    right = cot_response(347, 856)
    assert P.verification(right).split("\n") == ["7+6+0=13 ok", "4+5+1=10 ok", "3+8+1=12 ok", VERDICT_CORRECT]
    wrong = "\n".join(cot_lines(347, 856, wrong_column=1, delta=-1)[0] + ["Answer: 1193"])
    # 4+5+1=9 is wrong; 3+8+0=11 after it is right given its (wrong) carry, but the check has stopped
    assert P.verification(wrong).split("\n") == ["7+6+0=13 ok", "4+5+1=9 no", VERDICT_WRONG]
    assert parse_verdict(P.verification(wrong)) == 0 and parse_verdict(P.verification(right)) == 1


def test_sft_rows_put_the_earlier_turns_in_the_prompt(tmp_path):
    paths = P.write_task_files(tmp_path, "<V>", "<R>", n_sft=300, n_train=20, n_eval=10, seed=3)
    rows = [json.loads(x) for x in paths["sft"].read_text().splitlines()]
    kinds = {r["kind"] for r in rows}
    assert kinds == set(P.ROW_KINDS)
    for r in rows:
        a, b = map(int, r["problem"].split("+"))
        if r["kind"] == "solution":
            assert r["response"] == cot_response(a, b)
        elif r["kind"] == "verification":
            shown = r["prompt"].split(EOS_TOKEN)[0]
            claimed = int(shown.rsplit("Answer: ", 1)[1])
            assert r["prompt"].endswith(EOS_TOKEN + "<V>") and parse_verdict(r["response"]) == int(claimed == a + b)
            assert r["response"] == P.verification(shown[len(apply_template("arith", r["problem"])):])
        else:
            assert r["prompt"].endswith(VERDICT_WRONG + EOS_TOKEN + "<R>") and r["response"] == cot_response(a, b)
    problems = {json.loads(x)["problem"] for s in ("train", "eval") for x in paths[s].read_text().splitlines()}
    assert not problems & {r["problem"] for r in rows}  # disjoint splits


def test_an_unknown_sft_row_kind_names_the_task():
    from megarl.tasks import pag_pairsum, pag_sort

    for build, name in ((lambda k: P.sft_row(12, 34, k, random.Random(0), "V", "R"), "pag_arith"),
                        (lambda k: pag_pairsum.sft_row(("12345", 9), k, random.Random(0), "V", "R"), "pag_pairsum"),
                        (lambda k: pag_sort.sft_row("31524", k, random.Random(0), "V", "R"), "pag_sort")):
        with pytest.raises(ValueError, match=f"^{name}: unknown SFT row kind 'answer'$"):
            build("answer")
        assert build("solution")["prompt"]  # the known kinds still build
