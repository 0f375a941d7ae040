#!/usr/bin/env python3
"""TextWorld bridge: plays TextWorld games for rltune over the environment protocol.

    .venv-textworld/bin/python tools/textworld/bridge.py

JSON Lines requests on stdin, one response per request on stdout, logs on stderr. The
protocol, including every field, error kind, and the sanitising and cleaning rules
implemented here, is specified in docs/env-protocol.md. That page is the source of truth:
change it first, then this file, then test_bridge.py.
"""

import os
import sys

# Keep the protocol stream clean before anything else can print. Responses go to a private
# duplicate of fd 1. fd 1 itself then points at stderr, which catches C-level writes (Jericho's
# frotz), and print() goes to stderr too.
_PROTOCOL_OUT = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.stdout = sys.stderr

import json  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402
import unicodedata  # noqa: E402

import jericho  # noqa: E402
import textworld  # noqa: E402
from textworld import EnvInfos  # noqa: E402
from textworld.envs.wrappers import Filter  # noqa: E402

PROTOCOL = 1
MAX_ENVS = 4096
MAX_ACTION_CHARS = 200
MAX_SEED = 2**31 - 1

# Always requested: they fill the fixed members of the per-env result.
BASE_INFOS = ("admissible_commands", "objective", "inventory", "max_score", "won", "lost", "score")
INFO_NAMES = tuple(s for s in EnvInfos.__slots__ if s != "extras")

# Out-of-game commands refused by their first word (docs/env-protocol.md, "Action sanitising").
REFUSED_WORDS = frozenset(
    "quit q restart restore save script transcript unscript noscript undo version verify notify "
    "brief superbrief verbose".split()
)

STATUS_LINE = re.compile(r"\s*>?[ \t]*-= [^\n]*=-\s*-?\d+/\d+\s*\Z")
END_PROMPT = re.compile(r"\s*Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command\?\s*\Z")
CHAIN = re.compile(r"\.|\bthen\b", re.IGNORECASE)


class ProtocolError(Exception):
    """An error answered to the client as {"message": ..., "kind": ...}."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind
        self.message = message

    def to_json(self):
        return {"message": self.message, "kind": self.kind}


def log(msg):
    print(f"bridge: {msg}", file=sys.stderr, flush=True)


def exception_line(exc):
    """The last line of a traceback: 'ValueError: bad thing'."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


# ---------------------------------------------------------------------------------------------
# Text handling: pure functions.


def sanitize_action(action):
    """Returns (command, note): the command to send ('' if nothing is left) and why it changed."""
    notes = []
    lines = action.splitlines()
    text = lines[0] if lines else ""
    if len(lines) > 1:
        notes.append(f"kept the first line of {len(lines)}")
    cleaned = []
    for ch in text:
        if ch.isspace():
            cleaned.append(" ")
        elif unicodedata.category(ch) in ("Cc", "Cf"):
            continue
        else:
            cleaned.append(ch)
    text = " ".join("".join(cleaned).split())
    m = CHAIN.search(text)
    if m:
        cut = text[: m.start()].strip()
        if cut != text.rstrip("."):
            notes.append("kept the first command only ('.' and 'then' chain several turns)")
        text = cut
    if len(text) > MAX_ACTION_CHARS:
        text = text[:MAX_ACTION_CHARS].strip()
        notes.append(f"cut to {MAX_ACTION_CHARS} characters")
    return text, ("; ".join(notes) or None)


def refusal(command):
    """Why `command` must not reach the game, or None if it may."""
    if not command:
        return "refused: empty command"
    word = command.split()[0].lower()
    if word in REFUSED_WORDS or word.startswith("tw-"):
        return f"refused: '{word}' is an out-of-game command and was not sent"
    return None


def normalize_command(command):
    return " ".join(command.lower().split())


def clean_observation(text, strip_banner=False):
    """Removes the status line, the end-of-game prompt and (on reset) the ASCII-art banner."""
    text = STATUS_LINE.sub("", text)
    lines = text.rstrip().split("\n")
    if lines and lines[-1].lstrip().startswith(">"):
        lines.pop()  # A bare prompt that the status-line pattern did not catch.
    text = END_PROMPT.sub("", "\n".join(lines))
    lines = [line.strip() for line in text.split("\n")]
    if strip_banner:
        i = 0
        while i < len(lines) and not any(ch.isalnum() for ch in lines[i]):
            i += 1
        lines = lines[i:]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def to_json_value(value):
    """Makes TextWorld's info values JSON-safe (facts via serialize(), the rest via str())."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json_value(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return to_json_value(value.item())
        except Exception:
            pass
    if hasattr(value, "serialize") and callable(value.serialize):
        try:
            return to_json_value(value.serialize())
        except Exception:
            pass
    return str(value)


# ---------------------------------------------------------------------------------------------
# Parameter checking.


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def check_keys(params, allowed):
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ProtocolError("invalid_params", f"unknown params {unknown}; expected some of {sorted(allowed)}")


def require_int(params, name, lo, hi):
    value = params.get(name)
    if not is_int(value) or not lo <= value <= hi:
        raise ProtocolError("invalid_params", f"'{name}' must be an integer in {lo}..={hi}, got {value!r}")
    return value


def optional_list(params, name, length):
    value = params.get(name)
    if value is None:
        return [None] * length
    if not isinstance(value, list) or len(value) != length:
        raise ProtocolError("invalid_params", f"'{name}' must be a list of {length} entries (one per env), got {value!r}")
    return value


def check_game_file(path):
    """Raises game_error unless `path` looks like a TextWorld Z-machine game with its .json."""
    if not os.path.isfile(path):
        raise ProtocolError("game_error", f"game file not found: {path}")
    stem, ext = os.path.splitext(path)
    if ext == ".ulx":
        raise ProtocolError("game_error", f"not a playable game: {path} (Glulx .ulx games are not supported by textworld 1.7; make .z8 games)")
    if not re.fullmatch(r"\.z[1-8]", ext):
        raise ProtocolError("game_error", f"not a TextWorld game: {path} (expected a .z1-.z8 Z-machine file made by tw-make)")
    with open(path, "rb") as f:
        header = f.read(64)
    if len(header) < 64 or not 1 <= header[0] <= 8:
        raise ProtocolError("game_error", f"not a Z-machine story file: {path} (bad header)")
    sidecar = stem + ".json"
    try:
        with open(sidecar, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ProtocolError("game_error", f"not a TextWorld game: {path} has no {os.path.basename(sidecar)} beside it (tw-make writes one)")
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError("game_error", f"not a TextWorld game: {sidecar} is not valid JSON ({e})")
    if not isinstance(meta, dict):
        raise ProtocolError("game_error", f"not a TextWorld game: {sidecar} is not a JSON object")


# ---------------------------------------------------------------------------------------------
# Environments.


class Slot:
    """One environment: a TextWorld game plus the episode bookkeeping the protocol needs."""

    def __init__(self, index):
        self.index = index
        self.env = None
        self.game = None
        self.seed = None
        self.running = False  # True between a reset and the end of the episode.
        self.last = None  # The last per-env result (without step-only members).

    def start(self, game, path, env_infos):
        self.close()
        self.env = textworld.start(path, env_infos, wrappers=[Filter])
        self.game = game

    def close(self):
        if self.env is not None:
            try:
                self.env.close()
            except Exception as e:  # Closing must not fail a request.
                log(f"env {self.index}: close failed: {exception_line(e)}")
        self.env = None
        self.running = False


class Bridge:
    def __init__(self):
        self.slots = []
        self.games = []
        self.max_steps = None
        self.extra_infos = []
        self.env_infos = None
        self.walkthrough = False

    # -- methods ----------------------------------------------------------------------------

    def hello(self, params):
        check_keys(params, ["protocol"])
        if "protocol" in params and params["protocol"] != PROTOCOL:
            raise ProtocolError("invalid_params", f"this bridge speaks protocol {PROTOCOL}, the client asked for {params['protocol']!r}")
        return {
            "protocol": PROTOCOL,
            "name": "textworld",
            "version": textworld.__version__,
            "jericho_version": jericho.__version__,
            "max_action_chars": MAX_ACTION_CHARS,
            "walkthrough": True,
        }

    def init(self, params):
        check_keys(params, ["num_envs", "games", "max_steps", "request_infos", "walkthrough"])
        num_envs = require_int(params, "num_envs", 1, MAX_ENVS)
        max_steps = require_int(params, "max_steps", 1, 2**31 - 1)
        games = params.get("games")
        if not isinstance(games, list) or not games or not all(isinstance(g, str) for g in games):
            raise ProtocolError("invalid_params", f"'games' must be a non-empty list of paths, got {games!r}")
        extra = params.get("request_infos", [])
        if not isinstance(extra, list) or not all(isinstance(n, str) for n in extra):
            raise ProtocolError("invalid_params", f"'request_infos' must be a list of names, got {extra!r}")
        walkthrough = params.get("walkthrough", False)
        if not isinstance(walkthrough, bool):
            raise ProtocolError("invalid_params", f"'walkthrough' must be true or false, got {walkthrough!r}")
        basics, extras = set(BASE_INFOS), []
        if walkthrough:
            basics.add("policy_commands")
        for name in extra:
            if name.startswith("extra.") and len(name) > len("extra."):
                extras.append(name[len("extra."):])
            elif name in INFO_NAMES:
                basics.add(name)
            else:
                raise ProtocolError("invalid_params", f"unknown request_infos name {name!r}; expected one of {list(INFO_NAMES)} or 'extra.<name>'")
        paths = [os.path.abspath(g) for g in games]
        for path in paths:
            check_game_file(path)
        env_infos = EnvInfos(extras=extras, **{name: True for name in basics})

        self.shutdown()
        slots = []
        for i in range(num_envs):
            slot = Slot(i)
            slots.append(slot)
            game = i % len(paths)
            try:
                slot.start(game, paths[game], env_infos)
            except Exception as e:
                log(traceback.format_exc())
                for s in slots:
                    s.close()
                raise ProtocolError("game_error", f"could not start {paths[game]}: {exception_line(e)}")
        self.slots, self.games, self.max_steps = slots, paths, max_steps
        self.extra_infos, self.env_infos = list(dict.fromkeys(extra)), env_infos
        self.walkthrough = walkthrough
        return {"num_envs": num_envs, "max_steps": max_steps, "games": paths, "request_infos": self.extra_infos,
                "walkthrough": walkthrough}

    def reset(self, params):
        self.require_init()
        check_keys(params, ["envs", "seeds", "games"])
        envs = self.env_indices(params.get("envs", list(range(len(self.slots)))), "envs")
        seeds = optional_list(params, "seeds", len(envs))
        games = optional_list(params, "games", len(envs))
        for s in seeds:
            if s is not None and not (is_int(s) and 1 <= s <= MAX_SEED):
                raise ProtocolError("invalid_params", f"seeds must be integers in 1..={MAX_SEED} or null (Jericho reads 0 as 'no seed'), got {s!r}")
        for g in games:
            if g is not None and not (is_int(g) and 0 <= g < len(self.games)):
                raise ProtocolError("invalid_params", f"games must be indices in 0..{len(self.games)} or null, got {g!r}")
        results = []
        for i, seed, game in zip(envs, seeds, games):
            results.append(self.reset_one(self.slots[i], seed, game))
        return {"results": results}

    def step(self, params):
        self.require_init()
        check_keys(params, ["actions"])
        actions = params.get("actions")
        if not isinstance(actions, list) or not actions:
            raise ProtocolError("invalid_params", f"'actions' must be a non-empty list of {{\"env\": i, \"action\": text}}, got {actions!r}")
        for a in actions:
            if not isinstance(a, dict) or set(a) != {"env", "action"} or not isinstance(a["action"], str):
                raise ProtocolError("invalid_params", f"each action must be {{\"env\": i, \"action\": text}}, got {a!r}")
        envs = self.env_indices([a["env"] for a in actions], "actions[].env")
        return {"results": [self.step_one(self.slots[i], a["action"]) for i, a in zip(envs, actions)]}

    # -- per env ----------------------------------------------------------------------------

    def reset_one(self, slot, seed, game):
        try:
            if game is not None and (game != slot.game or slot.env is None):
                slot.start(game, self.games[game], self.env_infos)
            elif slot.env is None:  # An earlier failure closed it.
                slot.start(slot.game, self.games[slot.game], self.env_infos)
            if seed is not None:
                slot.seed = seed
            if slot.seed is not None:
                slot.env.seed(slot.seed)
            obs, infos = slot.env.reset()
        except Exception as e:
            log(f"env {slot.index}: reset failed\n{traceback.format_exc()}")
            slot.running = False
            return {"env": slot.index, "error": {"message": f"env {slot.index}: {exception_line(e)}", "kind": "env_error"}}
        result = self.result(slot, obs, infos, prev_score=None, moves=0, strip_banner=True)
        slot.running = not (result["terminated"] or result["truncated"])
        slot.last = result
        return result

    def step_one(self, slot, action):
        if not slot.running:
            why = "its episode has ended" if slot.last is not None else "it has not been reset since init"
            return {"env": slot.index, "error": {"message": f"env {slot.index}: {why}; reset first", "kind": "reset_required"}}
        command, note = sanitize_action(action)
        prev = slot.last
        moves = prev["moves"] + 1
        invalid = normalize_command(command) not in {normalize_command(c) for c in prev["admissible_commands"]}
        refused = refusal(command)
        if refused:
            result = dict(prev, reward=0.0, moves=moves)
            result["terminated"] = False  # prev was running, so it was not terminated.
            result["truncated"] = moves >= self.max_steps
            note = refused if note is None else f"{note}; {refused}"
        else:
            try:
                obs, _score, _done, infos = slot.env.step(command)
            except Exception as e:
                log(f"env {slot.index}: step {command!r} failed\n{traceback.format_exc()}")
                slot.running = False
                slot.close()  # Unknown state: the next reset restarts the game.
                return {"env": slot.index, "error": {"message": f"env {slot.index}: {exception_line(e)}", "kind": "env_error"}}
            result = self.result(slot, obs, infos, prev_score=prev["score"], moves=moves)
        slot.last = result
        slot.running = not (result["terminated"] or result["truncated"])
        return dict(result, sanitized_action=command, invalid=invalid, sent=not refused, note=note)

    def result(self, slot, obs, infos, prev_score, moves, strip_banner=False):
        score = int(infos.get("score") or 0)
        won, lost = bool(infos.get("won")), bool(infos.get("lost"))
        terminated = won or lost
        extra = {name: obs if name == "feedback" else to_json_value(infos.get(name)) for name in self.extra_infos}
        description = infos.get("description") if "description" in self.extra_infos else None
        result = {
            "env": slot.index,
            "game": slot.game,
            "observation": clean_observation(obs, strip_banner=strip_banner),
            "reward": 0.0 if prev_score is None else float(score - prev_score),
            "score": score,
            "max_score": int(infos.get("max_score") or 0),
            "terminated": terminated,
            "truncated": (not terminated) and moves >= self.max_steps,
            "won": won,
            "lost": lost,
            "moves": moves,
            "admissible_commands": [str(c) for c in (infos.get("admissible_commands") or [])],
            "objective": str(infos.get("objective") or ""),
            "inventory": str(infos.get("inventory") or "").strip(),
            "description": None if description is None else str(description).strip(),
            "infos": extra,
        }
        if self.walkthrough:
            # TextWorld's plan from this state; [] once the game is over or cannot be won.
            plan = [] if terminated else (infos.get("policy_commands") or [])
            result["walkthrough"] = [str(c) for c in plan]
        return result

    # -- helpers ----------------------------------------------------------------------------

    def require_init(self):
        if not self.slots:
            raise ProtocolError("not_initialized", "call init first")

    def env_indices(self, indices, name):
        if not isinstance(indices, list) or not indices:
            raise ProtocolError("invalid_params", f"'{name}' must be a non-empty list of env indices, got {indices!r}")
        for i in indices:
            if not is_int(i) or not 0 <= i < len(self.slots):
                raise ProtocolError("invalid_params", f"'{name}': env index {i!r} is out of range 0..{len(self.slots)}")
        if len(set(indices)) != len(indices):
            raise ProtocolError("invalid_params", f"'{name}': an env appears more than once: {indices}")
        return indices

    def shutdown(self):
        for slot in self.slots:
            slot.close()
        self.slots = []


# ---------------------------------------------------------------------------------------------
# The request loop.


def write(message):
    line = json.dumps(message, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    _PROTOCOL_OUT.write(line.encode("ascii") + b"\n")
    _PROTOCOL_OUT.flush()


def handle(bridge, raw):
    """Answers one request line. Returns True when the bridge should exit."""
    try:
        request = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        write({"id": None, "error": {"message": f"could not parse the request: {e}", "kind": "parse_error"}})
        return False
    if not isinstance(request, dict):
        write({"id": None, "error": {"message": "a request must be a JSON object", "kind": "invalid_request"}})
        return False
    rid = request.get("id")
    if not is_int(rid):
        write({"id": None, "error": {"message": f"'id' must be an integer, got {rid!r}", "kind": "invalid_request"}})
        return False
    method, params = request.get("method"), request.get("params", {})
    if not isinstance(method, str) or not isinstance(params, dict):
        write({"id": None, "error": {"message": "'method' must be a string and 'params' an object", "kind": "invalid_request"}})
        return False
    handlers = {"hello": bridge.hello, "init": bridge.init, "reset": bridge.reset, "step": bridge.step}
    if method == "close":
        bridge.shutdown()
        write({"id": rid, "result": {}})
        return True
    try:
        if method not in handlers:
            raise ProtocolError("unknown_method", f"unknown method {method!r}; expected one of {sorted(handlers) + ['close']}")
        write({"id": rid, "result": handlers[method](params)})
    except ProtocolError as e:
        write({"id": rid, "error": e.to_json()})
    except Exception as e:
        log(f"request {rid} ({method}) failed\n{traceback.format_exc()}")
        write({"id": rid, "error": {"message": exception_line(e), "kind": "internal"}})
    return False


def main():
    if len(sys.argv) > 1:
        print(__doc__, file=sys.stderr)
        return 2
    bridge = Bridge()
    stdin = sys.stdin.buffer
    try:
        while True:
            raw = stdin.readline()
            if not raw:
                break
            if not raw.strip():
                continue
            if handle(bridge, raw):
                break
    except BrokenPipeError:
        pass  # The client went away; nothing left to answer.
    finally:
        bridge.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
