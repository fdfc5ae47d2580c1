"""Reward functions named in the config: a built-in name, or `path/to/file.py:function` in the user's own code.

    fn = load_reward("gsm8k")                                                 # a built-in (REWARD_FNS)
    fn = load_reward("examples/rewards/verl_gsm8k_reward.py:compute_score")   # path relative to the working dir
    result = score_responses(fn, texts, examples)                             # one fn.score_batch call

A user's function is told apart by its parameter names and called the way its own framework calls it:

- verl's, once per response (it has a parameter `solution_str`): fn(data_source=example.meta["data_source"],
  solution_str=text, ground_truth=example.answer, extra_info=example.meta["extra_info"]), returning a number (a
  bool counts 0/1) or a dict whose "score" is one (its other keys are ignored);
- TRL's, once per batch (it has a parameter `completions`): fn(prompts=[...], completions=[...], answer=[...],
  **columns) with one entry per response, in batch order. A chat row's prompt is its messages and its completion
  [{"role": "assistant", "content": text}], as TRL passes them; `answer` holds the gold answers whatever their
  column is called in the data file, and `columns` are the rows' other columns (example.meta, None where a row
  lacks one); a function without **kwargs gets only those it names. It returns a list of numbers, None for "no
  reward";
- this package's own, once per response: fn(response, example), returning a number.

An exception in the user's code stops the run: RewardFunctionError names the file, the function and the sample,
and its `detail` is the traceback of the user's frames (the CLI prints it above the message). So does a return
value that is no reward (a string, a list of the wrong length). A None, NaN or inf reward is NaN for that sample,
and rollout.bad_reward decides whether that stops the run or drops the sample.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import traceback
from pathlib import Path

from moe_gspo.config.checks import ConfigError, UserError, names_a_module

_PACKAGE_DIR = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CUT = 60  # characters of a prompt, response or returned value quoted in an error message


class RewardFunctionError(UserError):
    """A user's reward function raised, or returned something that is not a reward. The message (one line) names
    the file, the function and the sample; `detail` holds the traceback of the user's own frames, if it raised."""


def _cut(text: str) -> str:
    return text if len(text) <= _CUT else text[:_CUT] + "..."


def _one_line(e: BaseException) -> str:
    """'Type: message' on one line; a SyntaxError also names its line."""
    if isinstance(e, SyntaxError):
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def _is_users_frame(filename: str, user_file: str) -> bool:
    """True for a frame of the user's file or of code outside this package (a library it calls); False for
    this package's frames and the import machinery's."""
    if filename.startswith("<frozen"):
        return False
    path = os.path.realpath(filename)
    return path == user_file or not path.startswith(_PACKAGE_DIR + os.sep)


def user_traceback(e: BaseException, user_file: str) -> str:
    """Python's traceback text for `e`, keeping only the frames _is_users_frame accepts."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_users_frame(f.filename, user_file)]
    return ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
            + "".join(traceback.format_exception_only(type(e), e)))


_NOT_A_REWARD = object()


def _as_reward(value):
    """float (NaN and inf included), None ("no reward"), or _NOT_A_REWARD. A dict gives its "score" (verl)."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if value is None:
        return None
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        return float(value)
    if isinstance(value, (str, bytes, dict, list, tuple)):
        return _NOT_A_REWARD
    try:
        return float(value)  # a one-element tensor or array
    except (TypeError, ValueError):
        return _NOT_A_REWARD


def _describe(value) -> str:
    kind = "dict without a 'score' key" if isinstance(value, dict) else type(value).__name__
    return f"{kind} {_cut(repr(value))}"


class UserReward:
    """A reward function from a user's file. score_responses calls `score_batch(texts, examples)` once per batch;
    calling the object scores one response. Subclasses hold each convention's way to call it."""

    batched = True

    def __init__(self, fn, name: str, file: str, path: str, signature: inspect.Signature):
        self.fn = fn
        self.__name__ = name
        self.file = file  # as the config wrote it
        self.path = path  # resolved: how its frames are recognised in a traceback
        self.signature = signature
        self.takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.__name__} from {self.file}>"

    def __call__(self, response: str, example) -> float:
        value = self.score_batch([response], [example])[0]
        return math.nan if value is None else value

    def score_batch(self, texts: list[str], examples: list) -> list[float | None]:
        """One reward per response (None: no reward); RewardFunctionError when the function fails."""
        raise NotImplementedError

    def accepted(self, kwargs: dict) -> dict:
        """The keyword arguments of `kwargs` the function takes (all of them when it has **kwargs)."""
        if self.takes_any:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self.signature.parameters}

    def _sample(self, i: int, texts, examples) -> str:
        return f"sample {i + 1} of {len(texts)} (prompt {_cut(examples[i].prompt)!r}, response {_cut(texts[i])!r})"

    def _raised(self, e: Exception, where: str) -> RewardFunctionError:
        return RewardFunctionError(f"reward function {self.__name__} in {self.file} raised on {where}: "
                                   f"{_one_line(e)}", detail=user_traceback(e, self.path))

    def _reward(self, value, i: int, texts, examples) -> float | None:
        reward = _as_reward(value)
        if reward is _NOT_A_REWARD:
            raise RewardFunctionError(f"reward function {self.__name__} in {self.file} returned {_describe(value)} "
                                      f"on {self._sample(i, texts, examples)}; expected a number (or None for no "
                                      f"reward)")
        return reward

    def _each(self, call, texts, examples) -> list[float | None]:
        """call(text, example) per response, its exceptions and non-rewards raised as RewardFunctionError."""
        out = []
        for i, (text, ex) in enumerate(zip(texts, examples)):
            try:
                value = call(text, ex)
            except Exception as e:  # noqa: BLE001 - the user's code: reported with its own frames
                raise self._raised(e, self._sample(i, texts, examples)) from e
            out.append(self._reward(value, i, texts, examples))
        return out


class VerlReward(UserReward):
    """fn(data_source, solution_str, ground_truth, extra_info=None), once per response."""

    def _call(self, text: str, ex):
        return self.fn(**self.accepted({"data_source": ex.meta.get("data_source"), "solution_str": text,
                                        "ground_truth": ex.answer, "extra_info": ex.meta.get("extra_info")}))

    def score_batch(self, texts, examples):
        return self._each(self._call, texts, examples)


class VerlScorerReward(UserReward):
    """fn(solution, ground_truth, ...), once per response: one of verl's per-source scorers
    (verl/utils/reward_score/math_verify.py's compute_score(model_output, ground_truth), gsm8k.py's, ...), called
    positionally as verl's default_compute_score calls them."""

    def score_batch(self, texts, examples):
        return self._each(lambda text, ex: self.fn(text, ex.answer), texts, examples)


class NativeReward(UserReward):
    """fn(response, example), once per response."""

    def score_batch(self, texts, examples):
        return self._each(self.fn, texts, examples)


class TrlReward(UserReward):
    """fn(prompts, completions, **columns), once per batch."""

    @staticmethod
    def columns(examples) -> list[str]:
        """The meta columns of a batch, in order of first appearance."""
        return list(dict.fromkeys(k for ex in examples for k in ex.meta))

    def kwargs(self, texts, examples, columns) -> dict:
        chat = [ex.messages is not None for ex in examples]
        kw = {c: [ex.meta.get(c) for ex in examples] for c in columns}
        kw["answer"] = [ex.answer for ex in examples]
        kw["prompts"] = [ex.messages if c else ex.prompt for ex, c in zip(examples, chat)]
        kw["completions"] = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        return self.accepted(kw)

    def _first_failing(self, texts, examples, columns) -> tuple[int, Exception] | None:
        """(index, exception) of the first response the function raises on when called with it alone."""
        for i in range(len(texts)):
            try:
                self.fn(**self.kwargs(texts[i:i + 1], examples[i:i + 1], columns))
            except Exception as e:  # noqa: BLE001 - the user's code
                return i, e
        return None

    def score_batch(self, texts, examples):
        columns = self.columns(examples)
        kw = self.kwargs(texts, examples, columns)
        try:
            self.signature.bind(**kw)
        except TypeError as e:
            raise RewardFunctionError(f"reward function {self.__name__} in {self.file} cannot be called with the "
                                      f"batch's columns {sorted(kw)}: {e}") from None
        try:
            values = self.fn(**kw)
        except Exception as e:  # noqa: BLE001 - the user's code: reported with its own frames
            # name the response it fails on, found by calling it on each one alone (the run stops either way)
            failing = self._first_failing(texts, examples, columns) if len(texts) > 1 else (0, e)
            if failing is None:
                raise self._raised(e, f"a batch of {len(texts)} (first: {self._sample(0, texts, examples)})") from e
            raise self._raised(failing[1], self._sample(failing[0], texts, examples)) from e
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != len(texts):
            size = f" ({len(values)} values)" if hasattr(values, "__len__") else ""
            raise RewardFunctionError(f"reward function {self.__name__} in {self.file} returned {_describe(values)}"
                                      f"{size} for a batch of {len(texts)} responses; expected a list of "
                                      f"{len(texts)} numbers (None for no reward)")
        return [self._reward(v, i, texts, examples) for i, v in enumerate(values)]


_CONVENTIONS = {  # name, the parameters that identify it, the wrapper, the form shown in errors
    "verl": (("solution_str",), VerlReward, "fn(data_source, solution_str, ground_truth, extra_info=None)"),
    "trl": (("completions",), TrlReward, "fn(prompts, completions, **kwargs)"),
    "native": (("response", "example"), NativeReward, "fn(response, example)"),
}


def _check_callable(sig: inspect.Signature, convention: str) -> None:
    """Raise TypeError when the function cannot take the arguments its convention passes."""
    if convention == "native":
        sig.bind(None, None)
    elif convention == "verl":
        takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        names = ("data_source", "solution_str", "ground_truth", "extra_info")
        sig.bind(**{n: None for n in names if takes_any or n in sig.parameters})
    else:  # TRL's: the columns are known per batch; prompts and completions must be keywords
        for p in sig.parameters.values():
            if p.kind is p.POSITIONAL_ONLY:
                raise TypeError(f"parameter {p.name!r} is positional-only; TRL passes keywords")


def _wrap(fn, name: str, shown: str, path: str, field: str) -> UserReward:
    where = f"{field}: {name} in reward file {shown}"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read its signature ({e})") from None
    forms = "; ".join(form for _, _, form in _CONVENTIONS.values()) + "; fn(solution, ground_truth) (verl's scorers)"
    hits = [c for c, (names, _, _) in _CONVENTIONS.items() if all(n in sig.parameters for n in names)]
    positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not hits and positional[1:2] == ["ground_truth"]:  # verl's per-source scorers: (solution, ground_truth, ...)
        try:
            sig.bind(None, None)
        except TypeError as e:
            raise ConfigError(f"{where}: signature {name}{sig} cannot be called as verl calls its scorers, "
                              f"fn(solution, ground_truth): {e}") from None
        return VerlScorerReward(fn, name, shown, path, sig)
    if len(hits) != 1:
        which = "matches none" if not hits else f"matches several ({', '.join(hits)})"
        raise ConfigError(f"{where}: signature {name}{sig} {which} of the reward conventions: {forms}")
    try:
        _check_callable(sig, hits[0])
    except TypeError as e:
        raise ConfigError(f"{where}: signature {name}{sig} cannot be called as "
                          f"{_CONVENTIONS[hits[0]][2]}: {e}") from None
    return _CONVENTIONS[hits[0]][1](fn, name, shown, path, sig)


def _import_file(path: str, shown: str, field: str):
    """Run the user's file as a module of its own (a name unique to its path)."""
    module_name = "moe_gspo_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # the file's dataclasses and pickling look their module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code: reported with its own frames
        del sys.modules[module_name]
        raise ConfigError(f"{field}: importing reward file {shown} raised {_one_line(e)}",
                          detail=user_traceback(e, path)) from e
    return module


def _from_module(module_name: str, name: str, field: str):
    """`name` from an importable module (TRL's `trl.rewards:accuracy_reward`, whose relative imports rule out loading
    its file alone), wrapped as a UserReward."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({_one_line(e)}); expected "
                          "'package.module:function' of an installed module or 'path/to/file.py:function'") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{field}: module {module_name} has no {name!r}")
    if not callable(fn):
        raise ConfigError(f"{field}: {module_name}:{name} is {_describe(fn)}, not a function")
    path = os.path.realpath(getattr(module, "__file__", None) or module_name)
    return _wrap(fn, name, f"{module_name}:{name}", path, field)


def load_reward(spec: str, field: str = "rollout.reward"):
    """The reward function `spec` names: a built-in (REWARD_FNS), `path/to/file.py:function` wrapped as a
    UserReward (a relative path is relative to the working directory; the file is imported, running its code), or
    `package.module:function` of an installed module.
    Any problem raises a one-line ConfigError naming `field` and the file."""
    from moe_gspo.rewards.builtin import REWARD_FNS, get_reward_fn

    if spec in REWARD_FNS:
        return get_reward_fn(spec)
    file, sep, name = spec.rpartition(":")
    if not sep:
        if spec.endswith(".py"):
            raise ConfigError(f"{field}={spec!r} names no function: write {field}={spec}:<function>")
        raise ConfigError(f"{field}={spec!r} is neither a built-in reward {sorted(REWARD_FNS)} nor "
                          f"path/to/file.py:function")
    if not file.endswith(".py"):
        if names_a_module(file) and name.isidentifier():
            return _from_module(file, name, field)
        raise ConfigError(f"{field}={spec!r}: {file!r} is not a Python file (.py); expected "
                          "'path/to/file.py:function' (or 'package.module:function' of an installed module)")
    if not name.isidentifier():
        raise ConfigError(f"{field}={spec!r}: {name!r} is not a function name; expected path/to/file.py:function")
    given = Path(file).expanduser()
    resolved = given if given.is_absolute() else Path.cwd() / given
    if not resolved.is_file():
        raise ConfigError(f"{field}: reward file {file} not found (looked for {resolved})")
    path = os.path.realpath(resolved)
    module = _import_file(path, file, field)
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        have = f"it defines {', '.join(defined)}" if defined else "it defines no functions"
        raise ConfigError(f"{field}: reward file {file} has no function {name!r}; {have}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{field}: {name} in reward file {file} is {_describe(fn)}, not a function")
    return _wrap(fn, name, file, path, field)


def load_rewards(spec: str | list[str], weights: list[float] | None = None, field: str = "rollout.reward"):
    """One reward function, or several (a list, TRL's reward_funcs) as a WeightedRewards with `weights` (TRL's
    reward_weights; None: 1 each). Each function's metrics go under its name: the built-in's, or the function's
    (numbered when two share one)."""
    from moe_gspo.rewards.score import WeightedRewards

    if isinstance(spec, str):
        return load_reward(spec, field)
    fns = [load_reward(s, f"{field}[{i}]") for i, s in enumerate(spec)]
    names = [s.rpartition(":")[2] for s in spec]  # a built-in's name, or the function's
    names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
    return WeightedRewards(fns, weights if weights is not None else [1.0] * len(fns), names)
