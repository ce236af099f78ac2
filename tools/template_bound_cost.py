"""What the bounds on chat templates cost (issue 32 item 2): the family's template (tests/templates) rendered for a
conversation of N turns by `qmtp.chat.render` (bounded: time, size, depth) and by transformers' own renderer (no
bounds) on the same messages, alternating, medians of many renders. Prints one JSON line.

    python tools/template_bound_cost.py [TURNS] [RENDERS]
"""

import json
import statistics
import sys
import time
from pathlib import Path

from qmtp import chat

TEMPLATE = Path(__file__).resolve().parent.parent / "tests" / "templates" / "qwen_family.jinja"


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i}: why is the sky blue? " * 8},
                     {"role": "assistant", "content": f"<think>\nreasoning {i}\n</think>\n\nAnswer {i}. " * 8}]
    return messages + [{"role": "user", "content": "And at sunset?"}]


def main(turns: int = 10, renders: int = 200) -> dict:
    from transformers.utils.chat_template_utils import render_jinja_template

    source = TEMPLATE.read_text()
    messages = conversation(turns)
    ours = chat.render(source, messages)
    theirs = render_jinja_template(conversations=[messages], chat_template=source, add_generation_prompt=True)[0][0]
    assert ours == theirs, "the two renderers disagree"
    times = {"qmtp (bounded)": [], "transformers": []}
    for _ in range(renders):
        t = time.perf_counter()
        chat.render(source, messages)
        times["qmtp (bounded)"].append(time.perf_counter() - t)
        t = time.perf_counter()
        render_jinja_template(conversations=[messages], chat_template=source, add_generation_prompt=True)
        times["transformers"].append(time.perf_counter() - t)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"turns": turns, "chars": len(ours), **{f"{k} ms": round(v, 3) for k, v in ms.items()},
            "ratio": round(ms["qmtp (bounded)"] / ms["transformers"], 2)}


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:]))))
