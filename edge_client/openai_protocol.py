"""The OpenAI HTTP API's shapes as `edge-client serve` speaks them: requests parsed and checked
(pydantic), what we do not support refused by name, errors in OpenAI's body shape, response
objects and stream chunks.

Sampling is exactly the target's (the verifier applies temperature, then top-k, then top-p), so
parameters that would change the distribution in a way the verifier does not implement
(penalties, logit bias, min-p) are refused with HTTP 400 rather than ignored.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers  # e.g. retry-after on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"'{param}' is not supported by this server: {why}", param=param,
                    code="unsupported_parameter")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints share. Unknown fields are accepted and ignored (apps send `user`,
    `metadata`, `store`...); known ones we cannot honour are refused in `refuse_unsupported`."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    # Sampling values are typed here and checked where the settings are built (SamplingSettings:
    # one rule for the whole project), which refuses a bad one with a 400 naming it.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                               # vLLM's extension: -1 or 0 = off
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                               # vLLM's extension
    coupling: str | None = None                            # ours: "rejection" | "gumbel" (default: serve's --coupling)
    n: int = Field(default=1, ge=1)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @property
    def stops(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_param(self) -> str:
        """The parameter that sets max_new_tokens, to name it in an error."""
        return "max_tokens"

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        if self.n > 1:
            raise unsupported("n", "one choice per request (send several requests)")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        for name, harmless, why in REFUSED:
            if name in extra and extra[name] not in harmless:
                raise unsupported(name, why)


_DISTRIBUTION = "the verifier samples the target's own distribution (temperature, top_k, top_p only)"
# (parameter, values that ask for nothing we lack, why it is refused otherwise)
REFUSED: list[tuple[str, tuple, str]] = [
    ("logprobs", (None, False, 0), "no log probabilities are computed on the edge"),
    ("top_logprobs", (None, 0), "no log probabilities are computed on the edge"),
    ("tools", (None, []), "no tool calling"),
    ("tool_choice", (None, "none"), "no tool calling"),
    ("functions", (None, []), "no function calling"),
    ("function_call", (None, "none"), "no function calling"),
    ("logit_bias", (None, {}), _DISTRIBUTION),
    ("presence_penalty", (None, 0), _DISTRIBUTION),
    ("frequency_penalty", (None, 0), _DISTRIBUTION),
    ("repetition_penalty", (None, 1), _DISTRIBUTION),
    ("min_p", (None, 0), _DISTRIBUTION),
    ("best_of", (None, 1), "one choice per request"),
    ("echo", (None, False), "the prompt is not echoed"),
    ("suffix", (None, ""), "no insertion (fill-in-the-middle)"),
    ("response_format", (None, {"type": "text"}), "no constrained output (JSON mode, schemas); text only"),
    ("modalities", (None, ["text"]), "text only"),
    ("audio", (None,), "text only"),
    ("prediction", (None,), "no predicted outputs"),
]


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def conversation(self) -> list[dict[str, str]]:
        """Messages as {"role", "content"} strings for the chat template; refuses images, audio, tools."""
        out = []
        for i, m in enumerate(self.messages):
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                if role in ("tool", "function"):
                    raise unsupported(f"messages[{i}].role", f"'{role}' messages need tool calling")
                raise APIError(400, f"messages[{i}].role must be system, developer, user or assistant, "
                                    f"got {role!r}", param=f"messages[{i}].role")
            if m.get("tool_calls") or m.get("function_call"):
                raise unsupported(f"messages[{i}].tool_calls", "no tool calling")
            out.append({"role": "system" if role == "developer" else role,
                        "content": self._text_of(i, m.get("content"))})
        return out

    @staticmethod
    def _text_of(i: int, content: Any) -> str:
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts",
                           param=f"messages[{i}].content")
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise unsupported(f"messages[{i}].content[{j}]", f"content parts of type {kind!r} "
                                  "(images, audio, files); text only")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]

    def prompt_value(self) -> str | list[int]:
        """One prompt: text, or token ids. Batches of prompts are refused (one choice per request)."""
        p = self.prompt
        if isinstance(p, list):
            if not p:
                raise APIError(400, "prompt is empty", param="prompt")
            if all(isinstance(x, int) for x in p):
                return list(p)  # type: ignore[arg-type]
            if len(p) > 1:
                raise unsupported("prompt", "one prompt per request (a batch of prompts was sent)")
            p = p[0]
        if isinstance(p, str) and not p:
            raise APIError(400, "prompt is empty", param="prompt")
        return p  # type: ignore[return-value]


def parse(model: type[SamplingRequest], body: Any) -> SamplingRequest:
    """A request body checked and parsed, or APIError(400) naming the first bad parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # loc is the path to the bad value, with pydantic's union branch names mixed in (`list[str]`)
        path = [x for x in err["loc"] if isinstance(x, int) or x in model.model_fields]
        param = str(path[0]) if path else None
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in path).lstrip(".") or "body"
        raise APIError(400, f"{where}: {err['msg']}", param=param) from None
    req.refuse_unsupported()
    return req


# --- responses --------------------------------------------------------------------------------

@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class ResponseShape:
    """Ids, timestamps and object names of one response (chat or text completion)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: Usage, extra: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            out = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("text_completion")
        out.update(choices=[choice], usage=usage.to_json(), **extra)
        return out

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              with_usage_field: bool = False, extra: dict | None = None) -> dict:
        if self.chat:
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if with_usage_field:
            out["usage"] = None  # OpenAI: null on every chunk but the last when include_usage is set
        out.update(extra or {})
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out.update(choices=[], usage=usage.to_json())
        return out

