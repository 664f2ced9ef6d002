"""The PAG pair-sum task (megarl/tasks/pag_pairsum.py): its turns and SFT rows, checked by hand."""

import json
import random

from megarl.rollout.multi_turn import VERDICT_CORRECT, VERDICT_WRONG, parse_verdict
from megarl.tasks import pag_pairsum as P
from megarl.tasks.tiny_model import EOS_TOKEN


def test_problems_have_exactly_one_pair():
    assert P.pairs_summing("38152", 9) == ["18"]
    assert P.pairs_summing("38152", 8) == ["35"]
    assert P.pairs_summing("38152", 6) == ["15"]  # 2+4 has no 4, 3+3 repeats a digit
    assert P.pairs_summing("38152", 10) == ["28"]
    assert P.pairs_summing("38152", 4) == ["13"] and P.pairs_summing("38152", 7) == ["25"]
    assert P.pairs_summing("38152", 11) == ["38"] and P.pairs_summing("38152", 17) == []
    problems = P.all_problems()
    assert len(problems) == 110400 and ("38152", 9) in problems and ("38152", 17) not in problems
    assert ("12345", 6) not in problems  # 1+5 and 2+4


def test_checks_by_hand_stop_at_the_first_failure():
    p = ("38152", 9)
    assert P.verification(p, "18").split("\n") == ["3- 8+ 1+ 5- 2-", "2 found ok", "1+8=9 ok", "1<8 ok", VERDICT_CORRECT]
    assert P.verification(p, "81").split("\n")[-3:] == ["8+1=9 ok", "8<1 no", VERDICT_WRONG]
    assert P.verification(p, "45").split("\n") == ["3- 8- 1- 5+ 2-", "1 found no", VERDICT_WRONG]  # 4 imagined
    assert P.verification(p, "35").split("\n")[-2:] == ["3+5=8 no", VERDICT_WRONG]
    assert P.verification(p, "33").split("\n") == ["1 digits no", VERDICT_WRONG]
    assert P.verification(p, "125").split("\n") == ["3 digits no", VERDICT_WRONG]


def test_wrong_answers_are_never_the_answer_and_always_caught():
    rng = random.Random(0)
    problems = P.all_problems()
    imagined = 0
    for _ in range(1000):
        p = rng.choice(problems)
        wrong = P.wrong_answer(p, rng)
        assert wrong != P.answer(p) and len(wrong) == 2
        assert parse_verdict(P.verification(p, wrong)) == 0
        imagined += any(c not in p[0] for c in wrong)
    assert 300 < imagined < 600  # ~45% name a digit the prompt lacks


def test_files_and_rows(tmp_path):
    paths = P.write_task_files(tmp_path, "<V>", "<R>", n_sft=300, n_train=30, n_eval=10, seed=2)
    evals = [json.loads(x) for x in paths["eval"].read_text().splitlines()]
    train = [json.loads(x) for x in paths["train"].read_text().splitlines()]
    assert not {r["problem"] for r in evals} & {r["problem"] for r in train}
    for r in evals:
        target, digits = r["problem"][len("sum "):-1].split(" in ")
        assert P.pairs_summing(digits, int(target)) == [r["answer"]] and r["data_source"] == "pag_pairsum"
    kinds = set()
    for r in (json.loads(x) for x in paths["sft"].read_text().splitlines()):
        kinds.add(r["kind"])
        if r["kind"] == "solution":
            assert r["prompt"] == r["problem"] and r["response"] == f"Answer: {r['answer']}"
        elif r["kind"] == "verification":
            shown = r["prompt"].split("\n", 1)[1].split(EOS_TOKEN)[0][len("Answer: "):]
            assert parse_verdict(r["response"]) == int(shown == r["answer"]) and r["prompt"].endswith("<V>")
        else:
            assert r["prompt"].endswith(VERDICT_WRONG + EOS_TOKEN + "<R>") and r["response"] == f"Answer: {r['answer']}"
    assert kinds == {"solution", "verification", "revision"}


def test_the_math_verifier_scores_the_answer_line():
    from megarl.rewards.math import is_correct

    assert is_correct("Answer: 18", "18") and not is_correct("Answer: 81", "18")
    assert not is_correct("Answer: 1", "18")


def test_the_quickstart_preset_fits_the_task():
    from megarl.config import load_config
    from megarl.tasks import quickstart_task

    cfg = load_config(["configs/quickstart/pag.yaml"])
    assert cfg.quickstart.task == "pag_pairsum" and quickstart_task("pag_pairsum").table_metrics == P.TABLE_METRICS
    assert cfg.reward["sources"]["pag_pairsum"] == "math" and cfg.data.prompt_template == "raw"
    assert max(len(P.problem_text(p)) for p in P.all_problems()) <= cfg.data.max_prompt_len  # one byte per token
    # the longest verification turn (and its end-of-text token) fits a turn's token budget
    longest = max(len(P.verification(("12345", 9), a)) for a in ("45", "36", "54"))
    assert longest + 1 <= cfg.rollout.max_new_tokens and longest + 1 <= cfg.eval.max_new_tokens
