"""The check process (`python -m kvreuse.structured.check_worker`), started and killed by check_process.CompileCheck.

Its first input line is the tokenizer (`{"tokenizer_info": xgrammar's JSON}`); it answers `{"ready": true}`. Then
each line is a format (`{"kind", "value"}`), compiled and thrown away; the answer is `{"seconds": s}` or, when the
engine refuses it, `{"error": message}`. It exits at the end of its input (its parent went away). It runs at a low CPU
priority (background.py).
"""

from __future__ import annotations

import json
import os
import sys
import time

import xgrammar as xgr

from kvreuse.background import lower_priority
from kvreuse.structured.compile_call import compile_format, new_compiler
from kvreuse.structured.errors import engine_message
from kvreuse.structured.formats import FormatSpec


def main() -> None:
    lower_priority()  # it and xgrammar's threads
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else writes to stdout (a library's print) goes to stderr, not into the answers
    sys.stdout = sys.stderr
    setup = json.loads(sys.stdin.readline())
    compiler = new_compiler(xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"]))
    replies.write('{"ready": true}\n')
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        try:
            compile_format(compiler, FormatSpec(request["kind"], request["value"]))
            reply = {"seconds": time.perf_counter() - start}
        except Exception as exc:  # xgrammar raises RuntimeError (and may raise others) for what it refuses
            reply = {"error": engine_message(exc)}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
