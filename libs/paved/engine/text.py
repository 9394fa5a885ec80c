"""Text every engine can take: Unicode scalar values only.

JSON may spell a lone UTF-16 surrogate (`"\\ud800"`) and Python then holds a `str` that
cannot be encoded as UTF-8: tokenizers raise TypeError deep inside, gRPC cannot send it. Such
input is refused at the edge (HTTP 400 / INVALID_ARGUMENT) with the path of the offending
field. NUL and other control characters are valid scalar values and pass through unchanged.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from paved.engine.protocol import ChatPrompt, InvalidRequestError


def unencodable_path(value: Any, path: str = "") -> str | None:
    """The path (`messages.0.content`) of the first string in `value` (nested dicts, lists)
    that is not valid Unicode text, or None. O(size); a single C-speed pass when all is well."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    # UnicodeEncodeError (a ValueError): some string is bad; TypeError: not plain JSON data;
    # RecursionError: very deep. The walk finds the place, or that all is well.
    except (ValueError, TypeError, RecursionError):
        pass
    return _walk(value, path)


def _walk(value: Any, path: str) -> str | None:
    # Iterative: request bodies may nest deeply and must not overflow the stack.
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return where or "(root)"
        elif isinstance(item, dict):
            entries = list(item.items())
            for key, child in reversed(entries):
                name = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and not _encodable(key):
                    return (where or "(root)") + " (a key)"
                stack.append((child, name))
        elif isinstance(item, list | tuple):
            for i in range(len(item) - 1, -1, -1):
                stack.append((item[i], f"{where}.{i}" if where else str(i)))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def message(path: str) -> str:
    return (
        f"{path} contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
        "which is not Unicode text"
    )


# A chat prompt larger than this (bytes of messages and tools) is rendered on a worker thread:
# a template over megabytes of messages takes from tens of milliseconds to seconds.
OFF_LOOP_RENDER_BYTES = 256 * 1024


async def render_chat_template_off_loop(tokenizer: Any, prompt: ChatPrompt, param: str) -> str:
    """render_chat_template, on a worker thread when the prompt is large."""
    size = prompt.size_hint or sum(len(m.get("content") or "") for m in prompt.messages)
    if size <= OFF_LOOP_RENDER_BYTES:
        return render_chat_template(tokenizer, prompt, param)
    return await asyncio.to_thread(render_chat_template, tokenizer, prompt, param)


def render_chat_template(tokenizer: Any, prompt: ChatPrompt, param: str) -> str:
    """`prompt` rendered as text by a Hugging Face tokenizer's chat template (its special tokens
    included: encode the result without adding them again). A template that raises on the
    messages (jinja2 errors, a template refusing a role order, a final message it cannot
    continue) is the caller's error: InvalidRequestError naming `param`, never a 500."""
    kwargs: dict[str, Any] = {
        "add_generation_prompt": prompt.add_generation_prompt,
        "tokenize": False,
    }
    if prompt.continue_final_message:
        kwargs["continue_final_message"] = True
    if prompt.tools:
        kwargs["tools"] = list(prompt.tools)
    try:
        # tokenize=False: the rendered text (transformers' annotation also covers token ids).
        return cast(str, tokenizer.apply_chat_template(list(prompt.messages), **kwargs))
    except Exception as e:
        raise InvalidRequestError(f"the model's chat template rejected the messages: {e}", param=param) from e
