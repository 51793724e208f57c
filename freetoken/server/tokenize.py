"""POST /tokenize and POST /detokenize, in vLLM's shapes, so anyone can check a chat template.

/tokenize takes {"model", "prompt", "add_special_tokens"} (raw text) or {"model", "messages",
"tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"} (the chat
template rendered exactly as for a chat request: the same messages, tool arguments as the
template reads them, the same template variables) and answers {"tokens", "count",
"max_model_len"}; "return_token_strs": true adds "token_strs". /detokenize takes {"model",
"tokens"} and answers {"prompt"}.
"""

from __future__ import annotations

from freetoken.server.errors import HTTPError
from freetoken.server.generation import template_messages
from freetoken.server.openai.chat import parse_messages
from freetoken.server.openai.params import bad, get_bool, get_dict
from freetoken.server.tools import check_tools


async def tokenize(ctx, request, response) -> None:
    body = request.json()
    ctx.check_model(body)
    tok = ctx.tokenizer
    if "messages" in body:
        ids = _chat_ids(ctx, body)
    elif isinstance(body.get("prompt"), str):
        ids = tok.encode(body["prompt"], add_special_tokens=get_bool(body, "add_special_tokens", True))
    else:
        raise bad("prompt", "give 'prompt' (a string) or 'messages' (a chat)")
    out = {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}
    if get_bool(body, "return_token_strs", False):
        out["token_strs"] = [tok.id_to_token(i) for i in ids]
    response.send_json(200, out)


def _chat_ids(ctx, body: dict) -> list[int]:
    messages = parse_messages(body)
    tools = check_tools(body.get("tools"))
    gen_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final = get_bool(body, "continue_final_message", False)
    if gen_prompt and continue_final:
        raise bad("continue_final_message", "'continue_final_message' and 'add_generation_prompt' "
                                            "cannot both be true")
    kwargs = ctx.meta.template_kwargs(None, get_dict(body, "chat_template_kwargs"))
    try:
        text = ctx.tokenizer.apply_chat_template(template_messages(messages), tools=tools,
                                                 add_generation_prompt=gen_prompt, **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise HTTPError(400, f"cannot render the chat template: {e}", type="invalid_request_error",
                        param="messages") from None
    if continue_final:      # the last assistant message stays open, as transformers does it
        last = messages[-1].get("content") or ""
        cut = text.rfind(last) if last else -1
        if cut >= 0:
            text = text[:cut + len(last)]
    return ctx.tokenizer.encode(text, add_special_tokens=get_bool(body, "add_special_tokens", False))


async def detokenize(ctx, request, response) -> None:
    body = request.json()
    ctx.check_model(body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise bad("tokens", "'tokens' must be a list of token ids")
    size = ctx.tokenizer.vocab_size
    out_of_range = [i for i in ids if not 0 <= i < size]
    if out_of_range:
        raise bad("tokens", f"token ids {out_of_range[:5]} are outside the vocabulary (0..{size - 1})")
    response.send_json(200, {"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)})
