"""Reading a stored profile's fields: where untrusted JSON becomes checked values.

A stored profile file is untrusted input. :meth:`trimkit.profile.Profile.from_dict` assembles a
profile from the readers here; each checks one field's type, count or range and raises
:class:`~trimkit.errors.ProfileError` naming the field (``samples[3].seconds``), never another
exception. The cost model must predict a positive, finite time for a 1- and a 1000-token prompt
(an all-zero model would predict 0 s forever, and live drift, a ratio to it, could never correct
it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from trimkit.decode_model import DecodePoint
from trimkit.errors import InvalidInputError, InvalidNumberError, ProfileError
from trimkit.planning.costs import CostModel, ErrorStats, PrefillSample
from trimkit.validation import count, non_negative_finite, real_float

__all__ = ["json_object", "json_field", "json_str", "json_bool", "json_int", "json_number", "must_be_finite", "checked",
           "read_model", "read_samples", "read_error", "read_residuals", "read_decode_points"]


def _where(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def json_object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where or 'the file'} must be a JSON object, got {type(value).__name__}")
    return value


def json_field(data: Mapping[str, Any], name: str, where: str = "") -> Any:
    if name not in data:
        raise ProfileError(f"{_where(where, name)} is missing")
    return data[name]


def json_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ProfileError(f"{where} must be a string, got {type(value).__name__}")
    return value


def json_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ProfileError(f"{where} must be true or false, got {type(value).__name__}")
    return value


def json_int(value: Any, where: str, minimum: int = 0) -> int:
    try:
        return count(value, where, minimum=minimum)
    except InvalidNumberError as exc:
        raise ProfileError(str(exc)) from None


def json_number(value: Any, where: str, check: Callable[[float, str], Any] | None = None) -> float:
    try:
        v = real_float(value)
        if check is not None:
            check(v, where)
    except InvalidInputError as exc:
        raise ProfileError(f"{where}: {exc}" if where not in str(exc) else str(exc)) from None
    return v


def must_be_finite(value: float, where: str) -> None:
    if not math.isfinite(value):
        raise InvalidNumberError(f"{where} must be finite, got {value!r}")


def checked(make: Callable[..., Any], where: str, **kwargs: Any) -> Any:
    """``make(**kwargs)``, its validation errors as a ProfileError naming ``where``."""
    try:
        return make(**kwargs)
    except InvalidInputError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def read_model(data: Any) -> CostModel:
    data = json_object(data, "model")
    kwargs = {name: json_number(json_field(data, name, "model"), f"model.{name}") for name in ("overhead_s", "per_token_s", "depth_s")}
    if "per_batch_s" in data:
        kwargs["per_batch_s"] = json_number(data["per_batch_s"], "model.per_batch_s")
    if "n_batch" in data:
        kwargs["n_batch"] = json_int(data["n_batch"], "model.n_batch", minimum=1)
    model: CostModel = checked(CostModel, "model", **kwargs)
    for n in (1, 1000):
        try:
            predicted = model.prefill_s(n, 0)
        except (OverflowError, ZeroDivisionError):  # pragma: no cover - coefficients are finite floats
            predicted = math.inf
        if not (predicted > 0 and math.isfinite(predicted)):
            raise ProfileError(f"model predicts {predicted!r} s for a {n}-token prompt (need a finite time > 0)")
    return model


def _read_sample(data: Any, where: str) -> PrefillSample:
    data = json_object(data, where)
    kwargs: dict[str, Any] = {
        "new_tokens": json_int(json_field(data, "new_tokens", where), f"{where}.new_tokens", minimum=1),
        "cached_tokens": json_int(json_field(data, "cached_tokens", where), f"{where}.cached_tokens"),
        "seconds": json_number(json_field(data, "seconds", where), f"{where}.seconds", non_negative_finite),
    }
    if "source" in data:
        kwargs["source"] = json_str(data["source"], f"{where}.source")
    return checked(PrefillSample, where, **kwargs)


def read_samples(data: Any) -> tuple[PrefillSample, ...]:
    if not isinstance(data, list):
        raise ProfileError(f"samples must be a list, got {type(data).__name__}")
    return tuple(_read_sample(s, f"samples[{i}]") for i, s in enumerate(data))


def read_error(data: Any) -> ErrorStats:
    data = json_object(data, "error")
    kwargs: dict[str, Any] = {name: json_number(json_field(data, name, "error"), f"error.{name}") for name in ("median_pct", "p90_pct", "max_pct")}
    kwargs["n"] = json_int(json_field(data, "n", "error"), "error.n")
    return checked(ErrorStats, "error", **kwargs)


def read_residuals(data: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(data, list):
        raise ProfileError(f"residuals must be a list, got {type(data).__name__}")
    out = []
    for i, pair in enumerate(data):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ProfileError(f"residuals[{i}] must be a [predicted, measured] pair")
        out.append(tuple(json_number(v, f"residuals[{i}][{j}]", non_negative_finite) for j, v in enumerate(pair)))
    return tuple(out)  # type: ignore[arg-type]


def read_decode_points(data: Any) -> tuple[DecodePoint, ...]:
    """``decode_points``: a list of objects (:meth:`~trimkit.decode_model.DecodePoint.to_dict`)."""
    if not isinstance(data, list):
        raise ProfileError(f"decode_points must be a list, got {type(data).__name__}")
    out = []
    for i, item in enumerate(data):
        where = f"decode_points[{i}]"
        item = json_object(item, where)
        kwargs: dict[str, Any] = {
            "context_tokens": json_number(json_field(item, "context_tokens", where), f"{where}.context_tokens", non_negative_finite),
            "tokens_per_s": json_number(json_field(item, "tokens_per_s", where), f"{where}.tokens_per_s"),
        }
        if "steps" in item:
            kwargs["steps"] = json_int(item["steps"], f"{where}.steps", minimum=1)
        if "source" in item:
            kwargs["source"] = json_str(item["source"], f"{where}.source")
        if item.get("spread_pct") is not None:
            kwargs["spread_pct"] = json_number(item["spread_pct"], f"{where}.spread_pct", non_negative_finite)
        out.append(checked(DecodePoint, where, **kwargs))
    return tuple(out)
