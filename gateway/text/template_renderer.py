"""The child that renders requests' chat templates (gateway/text/template_sandbox.py starts it):
`python -m spillway.gateway.text.template_renderer MAX_ADDRESS_SPACE_BYTES`.

It renders with transformers' own sandboxed Jinja environment, as the tokenizer's
apply_chat_template does, so a template renders here as it would in-process. Its address space
is capped once its modules are loaded; a template that outgrows the cap gets a MemoryError,
answered as a bound passed. It answers one frame per request on stdout and exits when stdin
closes (the gateway is gone).
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import sys

import msgspec

from spillway.gateway.text.template_sandbox import FRAME_HEADER, RenderFailed, Rendered, RendererReady, RenderTemplate, frame


def render(request: RenderTemplate, render_jinja_template) -> Rendered | RenderFailed:
    try:
        texts, _ = render_jinja_template(
            [request.messages], documents=request.documents, chat_template=request.template,
            continue_final_message=request.continue_final_message,
            add_generation_prompt=request.add_generation_prompt, **request.variables)
    except MemoryError:
        return RenderFailed("it needed more memory than the renderer's limit", past_limit=True)
    except RecursionError:
        return RenderFailed("it recursed too deeply", past_limit=False)
    except Exception as exc:  # jinja errors, raise_exception(), missing keys: the request's template
        return RenderFailed(str(exc), past_limit=False)
    if len(texts[0]) > request.max_chars:
        return RenderFailed(f"it rendered {len(texts[0])} characters, more than the {request.max_chars} "
                            "this model's context can take", past_limit=True)
    return Rendered(texts[0])


def _read_exactly(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if len(data) == size else None


def main(max_address_space: int) -> None:
    # Ctrl-C reaches the whole process group: the gateway stops this child when it shuts down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Frames go to the real stdout; anything printed (a library's warning) goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    from transformers.utils.chat_template_utils import render_jinja_template

    resource.setrlimit(resource.RLIMIT_AS, (max_address_space, max_address_space))
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(RenderTemplate)
    out.write(frame(encoder.encode(RendererReady())))
    stdin = sys.stdin.buffer
    while (header := _read_exactly(stdin, FRAME_HEADER.size)) is not None:
        payload = _read_exactly(stdin, FRAME_HEADER.unpack(header)[0])
        if payload is None:
            return
        reply = render(decoder.decode(payload), render_jinja_template)
        del payload
        try:
            encoded = frame(encoder.encode(reply))
        except MemoryError:
            encoded = frame(encoder.encode(RenderFailed("its output did not fit the renderer's memory limit",
                                                        past_limit=True)))
        del reply
        gc.collect()  # a failed rendering's cycles (frames, partial output) go now, not at the next one
        out.write(encoded)


if __name__ == "__main__":
    main(int(sys.argv[1]))
