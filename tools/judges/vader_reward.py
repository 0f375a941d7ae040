#!/usr/bin/env python3
"""VADER (Hutto & Gilbert, 2014) as an rltune reward command: the gold judge of
`rltune quickstart --task rlhf`.

The judge is PyPI's `nltk-vader-sentiment==1.0.0` (Apache-2.0, lexicons bundled, no
dependencies), imported as it ships; this file only speaks rltune's reward-command protocol
(docs/rewards.md, `kind = "command"`): one JSON line in per sample,
`{"query": ..., "response": ..., "meta": ...}`, one line out, `{"reward": compound}`, flushed,
in order. The response alone is scored (the review, not the request for it).

    tools/judges/install_vader.sh                 # -> target/judges/vader (git-ignored)
    echo '{"query": "q", "response": "A wonderful film."}' | python3 tools/judges/vader_reward.py

Environment: RLTUNE_VADER_DIR names the folder the package was installed into with
`pip install --target` (default: target/judges/vader beside this repository).
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.environ.get("RLTUNE_VADER_DIR") or os.path.join(HERE, "..", "..", "target", "judges", "vader")
sys.path.insert(0, TARGET)
try:
    from vader import SentimentIntensityAnalyzer, __version__
except ImportError as e:  # pragma: no cover - what a user without the package sees
    sys.stderr.write(
        f"vader_reward.py: cannot import vader from {TARGET} ({e}); run tools/judges/install_vader.sh "
        "or set RLTUNE_VADER_DIR to a `pip install --target` folder of nltk-vader-sentiment==1.0.0\n"
    )
    sys.exit(2)


def main() -> int:
    if __version__ != "1.0.0":
        sys.stderr.write(f"vader_reward.py: expected nltk-vader-sentiment 1.0.0, found {__version__}\n")
        return 2
    analyzer = SentimentIntensityAnalyzer()
    for n, line in enumerate(sys.stdin, 1):
        try:
            sample = json.loads(line)
            text = sample["response"]
            if not isinstance(text, str):
                raise TypeError(f"response is {type(text).__name__}, not a string")
        except (ValueError, KeyError, TypeError) as e:
            sys.stderr.write(f"vader_reward.py: input line {n}: {e}; expected a JSON object with a string \"response\"\n")
            return 2
        compound = analyzer.polarity_scores(text)["compound"]
        sys.stdout.write(json.dumps({"reward": compound}) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
