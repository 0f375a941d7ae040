#!/usr/bin/env python3
"""Drive `rltune serve` with the `openai` Python client (PyPI), as a user would.

    tools/openai/install.sh                      # once: .venv-openai with the openai package
    rltune serve --model DIR --port 8000 &
    .venv-openai/bin/python tools/openai/client_test.py --base-url http://127.0.0.1:8000/v1 --model NAME

crates/rltune-cli/tests/serve.rs runs it against a tiny model. Checks: /v1/models; completions
with n, seed and logprobs (the same seed gives the same token ids); chat with logprobs and
top_logprobs; eight concurrent chat requests equal to the same requests one at a time; and the
errors the client raises for an unknown model, a prompt over the context and an unknown field.
Exits 1 on the first failed check; prints "client_test.py: all checks passed" at the end.
"""

import argparse
import concurrent.futures
import sys

import openai


def check(cond, what):
    if not cond:
        print(f"client_test.py: FAILED: {what}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def extra(obj, field):
    """A field beyond OpenAI's schema (token_ids, prompt_token_ids), kept by the client."""
    return obj.to_dict().get(field)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
    model = args.model
    print(f"openai {openai.__version__} against {args.base_url}", flush=True)

    ids = [m.id for m in client.models.list().data]
    check(ids == [model], f"/v1/models lists {model}: {ids}")

    def complete():
        return client.completions.create(model=model, prompt="hello", max_tokens=8, n=2, seed=3, logprobs=2)

    c = complete()
    check(len(c.choices) == 2, "completions: n=2 gives two choices")
    for ch in c.choices:
        tokens = extra(ch, "token_ids")
        check(isinstance(tokens, list) and 1 <= len(tokens) <= 8, f"choice {ch.index}: token_ids {tokens}")
        check(len(ch.logprobs.token_logprobs) == len(tokens), "one logprob per token")
        check(all(len(t) <= 2 for t in ch.logprobs.top_logprobs), "at most 2 alternatives per token")
        check(ch.finish_reason in ("stop", "length"), f"finish_reason {ch.finish_reason}")
    check(c.usage.completion_tokens == sum(len(extra(ch, "token_ids")) for ch in c.choices), "usage counts tokens")
    again = complete()
    check(
        [extra(ch, "token_ids") for ch in again.choices] == [extra(ch, "token_ids") for ch in c.choices],
        "the same seed samples the same tokens",
    )

    def chat(seed):
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {seed}"}],
            max_tokens=6,
            seed=seed,
            logprobs=True,
            top_logprobs=2,
        )

    r = chat(1)
    ch = r.choices[0]
    tokens = extra(ch, "token_ids")
    check(ch.message.role == "assistant" and isinstance(ch.message.content, str), "chat: an assistant message")
    check(len(ch.logprobs.content) == len(tokens), "chat: one logprob entry per token")
    check(all(len(e.top_logprobs) == 2 for e in ch.logprobs.content), "chat: top_logprobs=2")
    check(r.usage.prompt_tokens == len(extra(r, "prompt_token_ids")), "chat: prompt_token_ids match usage")

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(chat, range(8)))
    alone = [chat(s) for s in range(8)]
    check(
        [extra(x.choices[0], "token_ids") for x in together] == [extra(x.choices[0], "token_ids") for x in alone],
        "8 concurrent chat requests answer what each answers alone",
    )

    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        check(False, "an unknown model is refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and "no-such-model" in str(e), f"unknown model: 404 ({e})")
    try:
        client.completions.create(model=model, prompt="word " * 100, max_tokens=4)
        check(False, "a prompt over the context is refused")
    except openai.BadRequestError as e:
        check(e.code == "context_length_exceeded", f"too long: 400 context_length_exceeded ({e})")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1, extra_body={"frobnicate": 1})
        check(False, "an unknown field is refused")
    except openai.BadRequestError as e:
        check("frobnicate" in str(e), f"unknown field: 400 naming it ({e})")

    print("client_test.py: all checks passed", flush=True)


if __name__ == "__main__":
    main()
