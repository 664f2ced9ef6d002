"""The PAG sorting task (megarl/tasks/pag_sort.py): its turns and SFT rows, checked by hand."""

import json
import random

from megarl.rollout.multi_turn import VERDICT_CORRECT, VERDICT_WRONG, parse_verdict
from megarl.tasks import pag_sort as P
from megarl.tasks.tiny_model import EOS_TOKEN


def test_checks_by_hand_stop_at_the_first_failure():
    ok = [f"{c} in ok" for c in "12589"] + ["1<2 ok", "2<5 ok", "5<8 ok", "8<9 ok", "5 digits ok"]
    assert P.verification("52819", "12589").split("\n") == ok + [VERDICT_CORRECT]
    assert P.verification("52819", "12389").split("\n") == ["1 in ok", "2 in ok", "3 in no", VERDICT_WRONG]
    assert P.verification("52819", "12598").split("\n")[-3:] == ["5<9 ok", "9<8 no", VERDICT_WRONG]
    assert P.verification("52819", "12258").split("\n")[-2:] == ["2<2 no", VERDICT_WRONG]  # a repeated digit
    assert P.verification("52819", "1289").split("\n")[-2:] == ["4 digits no", VERDICT_WRONG]


def test_wrong_answers_are_never_sorted_and_always_caught():
    rng = random.Random(0)
    for _ in range(500):
        digits = "".join(rng.sample("123456789", 5))
        wrong = P.wrong_answer(digits, rng)
        assert wrong != "".join(sorted(digits)) and len(wrong) in (4, 5)
        assert parse_verdict(P.verification(digits, wrong)) == 0


def test_files_and_rows(tmp_path):
    paths = P.write_task_files(tmp_path, "<V>", "<R>", n_sft=200, n_train=30, n_eval=10, seed=2)
    evals = [json.loads(x) for x in paths["eval"].read_text().splitlines()]
    train = [json.loads(x) for x in paths["train"].read_text().splitlines()]
    assert not {r["problem"] for r in evals} & {r["problem"] for r in train}
    assert all(r["answer"] == "".join(sorted(r["problem"][5:10])) and r["data_source"] == "pag_sort" for r in evals)
    for r in (json.loads(x) for x in paths["sft"].read_text().splitlines()):
        if r["kind"] == "solution":
            assert r["response"] == f"Answer: {r['answer']}"
        elif r["kind"] == "verification":
            shown = r["prompt"].split("\n", 1)[1].split(EOS_TOKEN)[0][len("Answer: "):]
            assert parse_verdict(r["response"]) == int(shown == r["answer"]) and r["prompt"].endswith("<V>")
        else:
            assert r["prompt"].endswith(VERDICT_WRONG + EOS_TOKEN + "<R>") and r["response"] == f"Answer: {r['answer']}"


def test_the_math_verifier_scores_the_answer_line():
    from megarl.rewards.math import is_correct

    assert is_correct("Answer: 12589", "12589") and not is_correct("Answer: 12598", "12589")
    assert not is_correct("Answer: 1258", "12589")
