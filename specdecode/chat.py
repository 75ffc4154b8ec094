"""`specdecode chat`: a conversation with the target on standard input, each reply decoded speculatively.

A line is a user turn; the reply streams as rounds are accepted, then one line of statistics goes to stderr.
The whole conversation is the next prompt (its chat template), so a reply follows from everything said so far,
as `generate` would decode it given the same turns. `/reset` forgets the conversation, `/exit` (or the end of
the input) ends it; a conversation that outgrows the target's context says so and waits for `/reset`.
"""

import sys
from collections.abc import Callable
from typing import TextIO

from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams

HELP = "a message a line; /reset forgets the conversation, /exit or the end of the input ends it"


def run_chat(
    decoder: SpeculativeDecoder,
    params: SamplingParams,
    max_new_tokens: int,
    note: Callable[[str], None],
    system: str | None = None,
    seed: int = 0,
    stop: tuple[str, ...] = (),
    lines: TextIO | None = None,
) -> None:
    """Answer each line of `lines` (standard input) in turn. Turn t samples with seed + t, so a seeded
    conversation replays."""
    lines = lines or sys.stdin
    opening = [{"role": "system", "content": system}] if system else []
    messages, interactive, turn = list(opening), lines.isatty(), 0
    note(HELP)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = lines.readline()
        text = line.strip()
        if not line or text == "/exit":
            return
        if text == "/reset":
            messages = list(opening)
            note("the conversation is forgotten")
            continue
        if not text:
            continue
        asked = [*messages, {"role": "user", "content": text}]
        prompt_ids = decoder.target.encode_chat(asked)
        try:
            decoder.check_prompt(prompt_ids)
        except SpecDecodeError as error:
            note(f"{error}; /reset starts a new conversation")
            continue
        reply = decoder.generate(
            prompt_ids,
            params,
            max_new_tokens=max_new_tokens,
            seed=seed + turn,
            stop=stop,
            on_text=lambda _i, piece: print(piece, end="", flush=True),
        )[0]
        print(flush=True)
        messages = [*asked, {"role": "assistant", "content": reply.text}]
        turn += 1
        note(reply.stats.summary())
