"""Chats on a model, turn by turn, for tests of what a conversation's cache keeps between turns."""

from __future__ import annotations

from umakit.generate.sampling import SamplingParams


def chat_turns(model, texts):
    """Each turn's (tokens reused, reply), and the replies of a chat that prefills everything again each turn."""
    from umakit.generate.chat import ChatSession
    from umakit.generate.transcript import ChatSettings

    settings = ChatSettings(max_tokens=6, sampling=SamplingParams(temperature=0))
    kept, fresh = ChatSession(model, settings), ChatSession(model, settings)
    out, again = [], []
    for text in texts:
        infos = []
        reply = "".join(c.text for c in kept.send(text, on_ready=infos.append))
        out.append((infos[0].reused_tokens, reply))
        fresh.resync()
        again.append("".join(c.text for c in fresh.send(text)))
    return out, again
