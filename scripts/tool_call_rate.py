"""How often a chat model calls a tool unprompted by training: each of N data-set prompts, with a system message that
names the tools (their JSON schemas) and the Hermes/Qwen call format, is answered greedily by transformers'
generate; counted are the responses that write <tool_call> and those whose calls parse (moe_gspo.rollout.tools).

    python scripts/tool_call_rate.py data/real/smollm2-135m-instruct data/real/gsm_symbolic/test.parquet \\
        examples/tools/calculator.py:calculate --n 20 [--json out.json]

The system message (moe_gspo.rollout.tools.tool_system_message, as rollout.tool_prompt gives it in training) is added
to the prompt's own (moe_gspo.tasks.prompts.with_system), since a chat template that ignores `tools=` (as SmolLM2's does) shows the model
nothing of them otherwise.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a Hugging Face chat model folder")
    ap.add_argument("data", help="a parquet or jsonl file whose `prompt` column holds chat messages")
    ap.add_argument("tools", nargs="+", help="file.py:function or module:function, as rollout.tools takes them")
    ap.add_argument("--n", type=int, default=20, help="prompts, the file's first (default 20)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", default=None, help="write the counts and each response here")
    args = ap.parse_args()

    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_gspo.rollout.tools import load_tools, parse_tool_calls, tool_schemas, tool_system_message
    from moe_gspo.tasks.prompts import with_system

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    schemas = tool_schemas(load_tools(args.tools))
    system = tool_system_message(schemas)  # what training's rollout.tool_prompt adds to the prompt
    rows = pd.read_parquet(args.data) if args.data.endswith(".parquet") else pd.read_json(args.data, lines=True)
    out, tagged, parsed, t0 = [], 0, 0, time.perf_counter()
    for i in range(min(args.n, len(rows))):
        messages = with_system([dict(m) for m in rows.iloc[i]["prompt"]], system)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                      tools=schemas)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        calls, _ = parse_tool_calls(text)
        tagged += "<tool_call>" in text
        parsed += bool(calls)
        out.append(text)
    n = len(out)
    print(f"{n} prompts: {tagged} wrote <tool_call>, {parsed} with a call that parses "
          f"({time.perf_counter() - t0:.0f} s, greedy, at most {args.max_new_tokens} new tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "data": args.data, "tools": args.tools, "n": n, "tool_call_tag": tagged,
                       "parsed_calls": parsed, "responses": out}, f, indent=1)


if __name__ == "__main__":
    main()
