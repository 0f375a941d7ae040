#!/usr/bin/env python3
"""Self-test of tools/textworld/bridge.py against docs/env-protocol.md.

    python3 tools/textworld/test_bridge.py [--python .venv-textworld/bin/python] [--games DIR]

Starts the bridge as a child process and speaks the protocol to it, as rltune's CommandEnv will:
handshake, init, reset, steps, the sanitising hazards (a newline, `quit`, chained commands),
won / lost / truncated episodes, a step after the end, seeds, malformed requests, close. Every
check prints a line; the last line is `N passed, M failed`; the exit status is 1 if any failed.
It also measures the mean time per `step` request. Needs only the standard library (the
bridge runs in the TextWorld venv); the games come from make_games.sh.
"""

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BRIDGE = os.path.join(REPO, "tools", "textworld", "bridge.py")
TIMEOUT_S = 60

COIN, CUSTOM, TREASURE = "coin5_s6.z8", "custom_w3_o5_q3_s2.z8", "treasure5_s4.z8"
RESULT_KEYS = {"env", "game", "observation", "reward", "score", "max_score", "terminated", "truncated", "won",
               "lost", "moves", "admissible_commands", "objective", "inventory", "description", "infos"}
STEP_KEYS = RESULT_KEYS | {"sanitized_action", "invalid", "sent", "note"}


class Bridge:
    """A protocol client: one request, one response, matched by id; stderr kept in a file."""

    def __init__(self, python, cwd, argv=None):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([python] + (argv or [BRIDGE]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, cwd=cwd)
        self.lines = queue.Queue()
        self.stray = []  # stdout lines that are not responses: the bridge must never write any.
        threading.Thread(target=self._read, daemon=True).start()
        self.next_id = 0

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send_raw(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def receive(self):
        while True:
            line = self.lines.get(timeout=TIMEOUT_S)
            if line is None:
                raise EOFError("the bridge closed stdout")
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and "id" in msg:
                return msg
            self.stray.append(line)

    def call(self, method, params=None):
        """Returns the whole response object."""
        self.next_id += 1
        req = {"id": self.next_id, "method": method}
        if params is not None:
            req["params"] = params
        self.send_raw((json.dumps(req) + "\n").encode())
        resp = self.receive()
        if resp.get("id") != self.next_id:
            raise AssertionError(f"response id {resp.get('id')} for request {self.next_id}")
        return resp

    def result(self, method, params=None):
        resp = self.call(method, params)
        if "result" not in resp:
            raise AssertionError(f"{method} failed: {resp}")
        return resp["result"]

    def stderr_text(self):
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")


class Checks:
    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, name, ok, detail=""):
        if ok:
            self.passed += 1
            print(f"ok    {name}")
        else:
            self.failed += 1
            print(f"FAIL  {name}: {detail}")
        return ok


def clean(obs):
    """An observation as the protocol promises it: no banner, no status line, no yes/no prompt."""
    return (isinstance(obs, str) and obs == obs.strip() and "$$" not in obs and "\n\n\n" not in obs
            and not re.search(r"-= .* =-\s*-?\d+/\d+\s*$", obs) and not obs.endswith(">")
            and "Would you like to RESTART" not in obs)


def step1(b, env, action):
    """Steps one env; returns its entry (result or per-env error)."""
    return b.result("step", {"actions": [{"env": env, "action": action}]})["results"][0]


def run(args, check):
    g = {name: os.path.join(args.games, name) for name in (COIN, CUSTOM, TREASURE)}
    missing = [p for p in g.values() if not os.path.isfile(p)]
    if missing:
        check("games exist (run tools/textworld/make_games.sh)", False, f"missing {missing}")
        return
    with tempfile.TemporaryDirectory() as cwd:
        run_in(args, check, g, cwd)
        left = os.listdir(cwd)
        check("the game wrote no files into the bridge's working directory (save, script)", not left, left)


def run_in(args, check, g, cwd):
    t0 = time.perf_counter()
    b = Bridge(args.python, cwd)

    # -- handshake and init ---------------------------------------------------------------------
    hello = b.result("hello", {"protocol": 1})
    check("hello answers protocol 1, textworld 1.7.x, walkthroughs available",
          hello.get("protocol") == 1 and hello.get("name") == "textworld" and str(hello.get("version")).startswith("1.7")
          and hello.get("walkthrough") is True, hello)
    print(f"      startup to first response: {time.perf_counter() - t0:.2f} s")
    r = b.call("hello", {"protocol": 2})
    check("hello with another protocol is invalid_params", r.get("error", {}).get("kind") == "invalid_params", r)
    r = b.call("reset")
    check("reset before init is not_initialized", r.get("error", {}).get("kind") == "not_initialized", r)

    with tempfile.TemporaryDirectory() as tmp:
        nogame = os.path.join(tmp, "notes.z8")
        with open(nogame, "w") as f:
            f.write("not a story file\n" * 8)
        lonely = os.path.join(tmp, "lonely.z8")  # a real story file without its .json
        with open(g[COIN], "rb") as src, open(lonely, "wb") as dst:
            dst.write(src.read())
        for label, path in [("missing file", os.path.join(tmp, "absent.z8")), ("text file", nogame),
                            ("story without .json", lonely), ("wrong extension", os.path.join(REPO, "README.md"))]:
            r = b.call("init", {"num_envs": 1, "games": [g[COIN], path], "max_steps": 5})
            err = r.get("error", {})
            check(f"init with a {label} is game_error naming the file",
                  err.get("kind") == "game_error" and path in err.get("message", ""), r)
    r = b.call("init", {"num_envs": 1, "games": [g[COIN]], "max_steps": 5, "request_infos": ["nonsense"]})
    check("init with an unknown request_infos name is invalid_params",
          r.get("error", {}).get("kind") == "invalid_params" and "nonsense" in r["error"]["message"], r)
    r = b.call("init", {"num_envs": 0, "games": [g[COIN]], "max_steps": 5})
    check("init with num_envs 0 is invalid_params", r.get("error", {}).get("kind") == "invalid_params", r)

    max_steps = 40
    init = b.result("init", {"num_envs": 2, "games": [g[COIN], g[CUSTOM], g[TREASURE]], "max_steps": max_steps,
                             "request_infos": ["policy_commands", "description"]})
    check("init returns absolute game paths", init.get("games") == [g[COIN], g[CUSTOM], g[TREASURE]] and
          init.get("num_envs") == 2, init)
    r = step1(b, 0, "look")
    check("step before the first reset is a per-env reset_required",
          r.get("error", {}).get("kind") == "reset_required", r)

    # -- reset ----------------------------------------------------------------------------------
    res = b.result("reset")["results"]
    check("reset without params resets every env, in order", [x.get("env") for x in res] == [0, 1], res)
    check("reset results have exactly the documented members", all(set(x) == RESULT_KEYS for x in res),
          [sorted(set(x) ^ RESULT_KEYS) for x in res])
    check("env i starts on game i % len(games)", [x["game"] for x in res] == [0, 1], [x["game"] for x in res])
    check("reset: reward 0.0, moves 0, not ended",
          all(x["reward"] == 0.0 and x["moves"] == 0 and not x["terminated"] and not x["truncated"] for x in res), res)
    check("reset observation: banner and status line stripped, objective kept",
          all(clean(x["observation"]) and x["objective"] and x["objective"][:40] in x["observation"] for x in res),
          [x["observation"][:200] for x in res])
    check("admissible commands are a sorted non-empty list of strings",
          all(x["admissible_commands"] == sorted(x["admissible_commands"]) and x["admissible_commands"] and
              all(isinstance(c, str) for c in x["admissible_commands"]) for x in res), res)
    check("requested infos are returned (description, infos.policy_commands)",
          all(isinstance(x["description"], str) and x["description"] and
              isinstance(x["infos"].get("policy_commands"), list) for x in res), [x["infos"] for x in res])
    check("max_score is 1 for these games, score 0", all(x["max_score"] == 1 and x["score"] == 0 for x in res), res)
    print(f"      admissible commands of {CUSTOM}: {res[1]['admissible_commands']}")

    # -- a few steps taking the first admissible command --------------------------------------
    last = {x["env"]: x for x in res}
    ok_shape = ok_moves = ok_valid = ok_reward = ok_clean = True
    for _ in range(3):
        acts = [{"env": i, "action": last[i]["admissible_commands"][0]} for i in (0, 1)]
        out = b.result("step", {"actions": acts})["results"]
        for x in out:
            prev = last[x["env"]]
            ok_shape &= set(x) == STEP_KEYS
            ok_moves &= x["moves"] == prev["moves"] + 1
            ok_valid &= x["invalid"] is False and x["sent"] is True and x["note"] is None
            ok_reward &= x["reward"] == x["score"] - prev["score"]
            ok_clean &= clean(x["observation"])
            last[x["env"]] = x
    check("step results have exactly the documented members", ok_shape)
    check("moves count steps", ok_moves)
    check("an admissible command is valid, sent, without note", ok_valid)
    check("reward is the score delta", ok_reward)
    check("step observations have no status line", ok_clean, [last[i]["observation"][-200:] for i in (0, 1)])

    # -- hazards: newline, quit, chains, empty, tw-*, unicode, length ----------------------------
    b.result("reset", {"envs": [0], "games": [0]})
    r = step1(b, 0, "look\ngo south")
    check("newline: only the first line is run, with a note",
          r["sanitized_action"] == "look" and "-= Kitchenette =-" in r["observation"] and "first line" in (r["note"] or ""), r)
    r = step1(b, 0, "inventory")
    check("newline: the rest was not queued (the next observation is not shifted)",
          "carrying nothing" in r["observation"] and "Basement" not in r["observation"], r["observation"])
    before = r
    r = step1(b, 0, "quit")
    check("quit is refused: not sent, invalid, note, observation unchanged",
          r["sent"] is False and r["invalid"] is True and "refused" in (r["note"] or "") and
          r["observation"] == before["observation"] and r["reward"] == 0.0 and r["moves"] == before["moves"] + 1, r)
    r = step1(b, 0, "go south")
    check("after a refused quit the game still plays (no yes/no prompt)",
          "Basement" in r["observation"] and "yes or no" not in r["observation"], r["observation"])
    r = step1(b, 0, "go west. quit")
    check("'.' chains are cut to the first command (quit never reaches the game)",
          r["sanitized_action"] == "go west" and r["sent"] is True and "yes or no" not in r["observation"], r)
    r = step1(b, 0, "look then quit")
    check("'then' chains are cut to the first command", r["sanitized_action"] == "look" and r["sent"] is True, r)
    for action in ["", "   \t ", "Q", "restart", "save", "script", "tw-extra-infos score", "superbrief"]:
        r = step1(b, 0, action)
        check(f"{action!r} is refused", r["sent"] is False and r["invalid"] is True and r["note"], r)
    r = step1(b, 0, "LOOK")
    check("case is ignored when judging invalid", r["invalid"] is False and r["sent"] is True, r)
    r = step1(b, 0, "go\tnorth\x00\x07")
    check("control characters: tab becomes a space, others dropped", r["sanitized_action"] == "go north", r)
    r = step1(b, 0, "café ☕ dance")
    check("non-ASCII is sent and answered, not an error", "error" not in r and r["sent"] and r["invalid"], r)
    r = b.result("reset", {"envs": [0]})["results"][0]
    r = step1(b, 0, "x" * 1000)
    check("long actions are cut to 200 characters", len(r["sanitized_action"]) == 200 and "200" in r["note"], r["note"])

    # -- won, then a step after the end next to a running env -----------------------------------
    b.result("reset", {"envs": [0, 1], "games": [0, 0]})
    walk = b.result("reset", {"envs": [0]})["results"][0]["infos"]["policy_commands"]
    rewards = []
    for cmd in walk:
        r = step1(b, 0, cmd)
        rewards.append(r["reward"])
    check("coin collector: walkthrough wins (terminated, won, not truncated)",
          r["won"] and r["terminated"] and not r["truncated"] and not r["lost"], r)
    check("rewards sum to the final score = max_score", sum(rewards) == r["score"] == r["max_score"] == 1, rewards)
    check("the final observation keeps the ending but not the RESTART/QUIT prompt",
          "*** The End ***" in r["observation"] and clean(r["observation"]), r["observation"])
    out = b.result("step", {"actions": [{"env": 0, "action": "look"}, {"env": 1, "action": "go south"}]})["results"]
    check("step after the end: per-env reset_required; the other env steps normally",
          out[0].get("error", {}).get("kind") == "reset_required" and "reset first" in out[0]["error"]["message"] and
          out[1].get("env") == 1 and "Basement" in out[1].get("observation", ""), out)
    r = step1(b, 1, "look")
    check("two envs on the same game are independent", "Basement" in r["observation"], r["observation"])

    # -- lost ---------------------------------------------------------------------------------
    b.result("reset", {"envs": [1], "games": [2]})
    step1(b, 1, "go east")
    r = step1(b, 1, "take sock")  # treasure hunter: taking the wrong object loses
    check("treasure hunter: the wrong object loses (terminated, lost, reward 0)",
          r["lost"] and r["terminated"] and not r["won"] and not r["truncated"] and r["reward"] == 0.0, r)
    print(f"      inventory reported after losing: {r['inventory']!r}")

    # -- truncated: the cap counts refused actions too ------------------------------------------
    r = b.result("reset", {"envs": [1], "games": [0]})["results"][0]
    ended = []
    for k in range(max_steps):
        r = step1(b, 1, "quit" if k % 3 == 1 else "look")
        ended.append(r["terminated"] or r["truncated"])
    check(f"truncated exactly at moves == max_steps ({max_steps}), refused steps counted",
          r["truncated"] and not r["terminated"] and r["moves"] == max_steps and ended == [False] * (max_steps - 1) + [True], r)
    r = step1(b, 1, "look")
    check("step after truncation is reset_required", r.get("error", {}).get("kind") == "reset_required", r)

    # -- seeds --------------------------------------------------------------------------------
    trajectories = []
    for seed in [1, 2, None]:
        first = b.result("reset", {"envs": [1], "seeds": [seed], "games": [1]})["results"][0]
        obs = [first["observation"]] + [step1(b, 1, c)["observation"] for c in first["infos"]["policy_commands"]]
        trajectories.append(obs)
    check("the same game gives the same observations with seeds 1, 2 and null",
          trajectories[0] == trajectories[1] == trajectories[2])
    r = b.call("reset", {"envs": [1], "seeds": [0]})
    check("seed 0 is invalid_params", r.get("error", {}).get("kind") == "invalid_params", r)

    walkthroughs(b, check, g, max_steps)

    # -- malformed requests -------------------------------------------------------------------
    b.send_raw(b"{this is not json\n")
    r = b.receive()
    check("bad JSON: parse_error with id null", r.get("id") is None and r.get("error", {}).get("kind") == "parse_error", r)
    b.send_raw(b"\xff\xfe\n")
    r = b.receive()
    check("invalid UTF-8: parse_error with id null", r.get("id") is None and r.get("error", {}).get("kind") == "parse_error", r)
    b.send_raw(b"[1, 2]\n")
    r = b.receive()
    check("a JSON array: invalid_request with id null", r.get("id") is None and r["error"]["kind"] == "invalid_request", r)
    b.send_raw(b'{"method": "hello"}\n')
    r = b.receive()
    check("no id: invalid_request with id null", r.get("id") is None and r["error"]["kind"] == "invalid_request", r)
    r = b.call("dance")
    check("unknown method: unknown_method with the id", r.get("error", {}).get("kind") == "unknown_method", r)
    for label, params in [("duplicate env", {"actions": [{"env": 0, "action": "a"}, {"env": 0, "action": "b"}]}),
                          ("env out of range", {"actions": [{"env": 2, "action": "look"}]}),
                          ("non-string action", {"actions": [{"env": 0, "action": 3}]}),
                          ("unknown param", {"actions": [{"env": 0, "action": "look"}], "speed": 2})]:
        r = b.call("step", params)
        check(f"step with {label}: invalid_params", r.get("error", {}).get("kind") == "invalid_params", r)
    r = b.call("reset", {"envs": [0], "games": [7]})
    check("reset with a game index out of range: invalid_params", r.get("error", {}).get("kind") == "invalid_params", r)

    # -- timing: mean time per step request --------------------------------------------------
    for label, infos, walk in [("default infos", [], False), ("+description", ["description"], False),
                               ("+walkthrough", [], True)]:
        for n_envs in (1, 8):
            b.result("init", {"num_envs": n_envs, "games": [g[COIN], g[CUSTOM], g[TREASURE]], "max_steps": 20,
                              "request_infos": infos, "walkthrough": walk})
            last = {x["env"]: x for x in b.result("reset")["results"]}
            n_req, spent, k = 200 if n_envs == 1 else 50, 0.0, 0
            for k in range(n_req):
                acts = [{"env": i, "action": x["admissible_commands"][k % len(x["admissible_commands"])]}
                        for i, x in last.items()]
                t = time.perf_counter()
                out = b.result("step", {"actions": acts})["results"]
                spent += time.perf_counter() - t
                ended = [x["env"] for x in out if x["terminated"] or x["truncated"]]
                last.update({x["env"]: x for x in out})
                if ended:
                    last.update({x["env"]: x for x in b.result("reset", {"envs": ended})["results"]})
            print(f"      step latency, {label}, {n_envs} env(s): {spent / n_req * 1000:.2f} ms per request, "
                  f"{spent / n_req / n_envs * 1000:.2f} ms per env-step ({n_req} requests)")

    # -- close ----------------------------------------------------------------------------------
    r = b.call("close")
    check("close answers {}", r.get("result") == {}, r)
    try:
        rc = b.proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        b.proc.kill()
        rc = None
    check("the bridge exits 0 after close", rc == 0, rc)
    check("stdout carried only responses (no stray lines)", not b.stray, b.stray[:3])
    if check.failed:
        print("---- bridge stderr ----\n" + b.stderr_text()[-4000:])

    # -- end of input --------------------------------------------------------------------------
    b2 = Bridge(args.python, cwd)
    b2.result("hello")
    b2.proc.stdin.close()
    try:
        rc = b2.proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        b2.proc.kill()
        rc = None
    check("end of stdin: the bridge exits 0", rc == 0, rc)

    # -- stray output from code running inside the bridge goes to stderr ------------------------
    noisy = ("import os, runpy, sys; g = runpy.run_path(sys.argv[1], run_name='bridge'); "
             "print('stray print'); os.write(1, b'stray fd write\\n'); os.system('echo stray child'); "
             "sys.argv[1:] = []; sys.exit(g['main']())")
    b3 = Bridge(args.python, cwd, argv=["-c", noisy, BRIDGE])
    b3.result("hello")
    b3.result("close")
    b3.proc.wait(timeout=TIMEOUT_S)
    err = b3.stderr_text()
    check("print(), fd-1 writes and child processes inside the bridge reach stderr, not the protocol stream",
          not b3.stray and all(s in err for s in ("stray print", "stray fd write", "stray child")), (b3.stray, err[-300:]))


def walkthroughs(b, check, g, max_steps):
    """init's walkthrough flag: a plan in every result that wins from any state, detours included."""
    r = b.call("init", {"num_envs": 1, "games": [g[COIN]], "max_steps": 5, "walkthrough": "yes"})
    check("init with a non-boolean walkthrough is invalid_params",
          r.get("error", {}).get("kind") == "invalid_params" and "walkthrough" in r["error"]["message"], r)
    init = b.result("init", {"num_envs": 1, "games": [g[COIN], g[CUSTOM], g[TREASURE]], "max_steps": max_steps,
                             "walkthrough": True})
    check("init echoes walkthrough: true", init.get("walkthrough") is True, init)
    first = b.result("reset", {"envs": [0], "games": [0]})["results"][0]
    plan = first.get("walkthrough")
    check("with walkthrough, results have the documented members plus walkthrough",
          set(first) == RESULT_KEYS | {"walkthrough"} and isinstance(plan, list) and plan and
          all(isinstance(c, str) for c in plan), first)
    # Following the plan: each step's walkthrough is the rest of the plan; [] once won.
    rests, r = [], first
    for cmd in plan:
        r = step1(b, 0, cmd)
        rests.append(r.get("walkthrough"))
    check("coin collector: each step's walkthrough is the rest of the plan, [] after the win",
          r["won"] and rests == [plan[k + 1:] for k in range(len(plan))], (plan, rests))

    # A detour: the plan's first move, then an exit off the plan; the walkthrough walks back.
    first = b.result("reset", {"envs": [0], "games": [1]})["results"][0]
    r = step1(b, 0, first["walkthrough"][0])
    off = [c for c in r["admissible_commands"] if c.startswith("go ") and c != r["walkthrough"][0]]
    r = step1(b, 0, off[0]) if off else r
    back = r["walkthrough"]
    r2 = step1(b, 0, "quit")
    check("a refused action keeps the walkthrough", r2["walkthrough"] == back, (back, r2["walkthrough"]))
    for _ in range(max_steps):
        if r2["terminated"] or r2["truncated"] or not r2["walkthrough"]:
            break
        r2 = step1(b, 0, r2["walkthrough"][0])
    check(f"custom: after a detour ({off[:1]}), following the walkthrough wins",
          bool(off) and back[:1] == first["walkthrough"][:1] and r2["won"] and r2["walkthrough"] == [],
          (off, back, r2))
    print(f"      walkthrough from the start of {CUSTOM}: {first['walkthrough']}; after {off[:1]}: {back}")

    # Losing empties it.
    b.result("reset", {"envs": [0], "games": [2]})
    step1(b, 0, "go east")
    r = step1(b, 0, "take sock")
    check("treasure hunter: after a loss the walkthrough is []", r["lost"] and r["walkthrough"] == [], r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=os.path.join(REPO, ".venv-textworld", "bin", "python"),
                    help="interpreter with textworld installed (default: .venv-textworld/bin/python)")
    ap.add_argument("--games", default=os.path.join(REPO, "target", "textworld-games"),
                    help="folder written by make_games.sh (default: target/textworld-games)")
    args = ap.parse_args()
    args.games = os.path.abspath(args.games)
    check = Checks()
    try:
        run(args, check)
    except Exception as e:  # a crash or a hang is a failure, reported like the others
        check("the test ran to the end", False, f"{type(e).__name__}: {e}")
    print(f"{check.passed} passed, {check.failed} failed")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
