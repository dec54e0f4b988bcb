"""When a sequence ends after its newest token: EOS, a stop token, a stop string, max_tokens or the context limit."""

from __future__ import annotations

from kvreuse.engine.detokenizer import detokenize, find_stop, stop_search_start
from kvreuse.engine.sequence import Sequence
from kvreuse.weights.tokenizer import Tokenizer


class StopCheck:
    """Called with a sequence and the token just appended to it (`Scheduler.postprocess`): detokenizes the new token
    (incrementally) and returns why the sequence finishes ("stop" or "length"), or None. Stops are searched only where
    the new text can complete one, with the same result as searching the whole text every step (see
    detokenizer.py). On a finish, `seq.detokenized.text` becomes what decoding the whole completion gives, cut before a
    stop string, a cut-short character as U+FFFD."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def __call__(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        reason = None
        if (not params.ignore_eos and token_id in self.tokenizer.eos_token_ids) or token_id in params.stop_token_ids:
            reason = "stop"
        out = seq.detokenized
        search_from = stop_search_start(len(out.text), params.stop)
        pending = detokenize(self.tokenizer, out, seq.token_ids, seq.num_prompt_tokens)  # a character cut short, if any
        text = out.text + pending
        cut = find_stop(text, params.stop, search_from) if params.stop else -1
        if cut >= 0:
            text, reason = text[:cut], "stop"
        elif reason is None and (seq.num_completion_tokens >= params.max_tokens
                                 or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            out.text = text
        return reason
