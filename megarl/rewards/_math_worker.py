"""math-verify worker process for `megarl.rewards.math_pool` (run as a script, not imported).

Protocol, one JSON object per line: request `{"gold": str, "pred": str, "timeout": int}` on
stdin; reply `{"correct": bool}`, `{"timeout": true}` or `{"error": str}` on stdout. The first
line written is `{"ready": true}` once math-verify is imported.

math-verify's own signal-based timeouts (per parse / verify call) work here because this is
the main thread; they are the soft limit: math-verify then returns "not equal", and we report
a timeout instead when the call ran that long. The hard limit is the parent's deadline: it
kills this process (a long computation inside C code does not see the signal).
"""

import json
import logging
import resource
import sys
import time


def main() -> None:
    memory_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    logging.disable(logging.WARNING)  # math-verify logs every parse failure
    from math_verify import parse, verify

    # The first latex parse builds the ANTLR parser and sympy caches (~0.3 s); pay it here, not
    # inside the first check's deadline.
    verify(parse("$\\frac{1}{2}$"), parse("$(0.5, \\sqrt{2}]$"))
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            t = max(1, int(req.get("timeout", 5)))
            start = time.monotonic()
            gold = parse(f"${req['gold']}$", parsing_timeout=t)
            pred = parse(f"${req['pred']}$", parsing_timeout=t)
            correct = bool(gold and pred and verify(gold, pred, timeout_seconds=t))
            # each call has its own t-second alarm; a run this long means one of them fired
            reply = {"timeout": True} if time.monotonic() - start >= t else {"correct": correct}
        except BaseException as e:  # noqa: BLE001 - reported to the parent, never fatal
            if isinstance(e, KeyboardInterrupt):
                raise
            reply = {"error": f"{type(e).__name__}: {e}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
