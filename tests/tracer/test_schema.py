"""The trace-file checkers one by one: what each accepts, what it returns, and the exact sentence and field
of each refusal. The hostile-file tests reach them through whole files; these pin each rule where it is
written, so a change to one bound or one message fails here first (and fast, under mutation testing)."""

from __future__ import annotations

import math

import pytest

from gpt_shape_tracer.tracer.files._schema import (
    Bool,
    Check,
    Float,
    Int,
    ListOf,
    Maybe,
    Obj,
    OneOf,
    Str,
    Then,
    TraceFileError,
    TupleOf,
)


def refusal(check: Check, value: object, where: str = "w") -> TraceFileError:
    with pytest.raises(TraceFileError) as e:
        check(value, where)
    return e.value


def test_an_error_names_its_field_only_when_it_has_one():
    e = TraceFileError("missing", "generation.steps[3].t")
    assert str(e) == "generation.steps[3].t: missing" and e.field == "generation.steps[3].t"
    plain = TraceFileError("not a zip file")
    assert str(plain) == "not a zip file" and plain.field == ""
    assert isinstance(plain, ValueError)


def test_the_base_check_checks_nothing_by_itself():
    with pytest.raises(NotImplementedError):
        Check()(1, "w")


def test_whole_numbers_default_to_zero_up_to_two_to_the_53():
    count = Int()
    assert count(0, "n") == 0 and count(2**53, "n") == 2**53
    assert str(refusal(count, -1, "n")) == f"n: -1 is outside [0, {2**53}]"
    assert str(refusal(count, 2**53 + 1, "n")) == f"n: {2**53 + 1} is outside [0, {2**53}]"
    assert str(refusal(count, "inf", "n")) == "n: expected a whole number, got str 'inf'"
    assert str(refusal(count, None, "n")) == "n: expected a whole number, got null 'None'"
    assert str(refusal(Int(1, 4), 0, "n")) == "n: 0 is outside [1, 4]"
    assert str(refusal(Int(1, 4), 2.0, "n")) == "n: expected a whole number, got float '2.0'"
    assert Int(1, 4)(1, "n") == 1 and Int(1, 4)(4, "n") == 4  # both ends are in range


def test_numbers_default_to_any_finite_value_and_come_back_as_floats():
    x = Float()
    assert x(-1e308, "x") == -1e308 and x(1e308, "x") == 1e308
    assert type(x(3, "x")) is float and x(3, "x") == 3.0
    assert str(refusal(x, math.nan)) == "w: expected a finite number, got nan"
    assert str(refusal(x, -math.inf)) == "w: expected a finite number, got -inf"
    assert str(refusal(x, "nan")) == "w: expected a number, got str 'nan'"
    assert str(refusal(x, False)) == "w: expected a number, got bool 'False'"
    assert str(refusal(Float(0, 1), 1.5)) == "w: 1.5 is outside [0, 1]"
    assert str(refusal(Float(0, 1), -0.5)) == "w: -0.5 is outside [0, 1]"
    assert Float(0, 1)(0, "w") == 0.0 and Float(0, 1)(1, "w") == 1.0
    anything = Float(finite=False)
    assert anything(-math.inf, "w") == -math.inf and anything("-inf", "w") == -math.inf
    assert anything("inf", "w") == math.inf  # the three spellings JSON output uses for what JSON cannot write
    assert math.isnan(anything(math.nan, "w"))  # NaN is in no range, and is let through when allowed
    assert math.isnan(Float(0, 1, finite=False)("nan", "w"))


def test_a_refused_value_is_quoted_to_40_characters():
    long = "x" * 50
    assert str(refusal(Int(), long)) == f"w: expected a whole number, got str {'x' * 40!r}"
    assert str(refusal(OneOf(("a", "b")), long)) == f"w: {'x' * 40!r} is not one of 'a', 'b'"


def test_text_up_to_its_limit():
    assert Str(3)("abc", "name") == "abc" and Str(3)("", "name") == ""
    assert str(refusal(Str(3), "abcd", "name")) == "name: text of 4 characters, over the limit of 3"
    assert str(refusal(Str(3), 12, "name")) == "name: expected text, got int"
    assert str(refusal(Str(3), None, "name")) == "name: expected text, got null"
    assert Str()("y" * 10_000, "w") == "y" * 10_000
    assert "10001 characters" in str(refusal(Str(), "y" * 10_001))


def test_true_or_false_and_nothing_that_compares_equal():
    assert Bool()(True, "b") is True and Bool()(False, "b") is False
    assert str(refusal(Bool(), 1, "b")) == "b: expected true or false, got int"
    assert str(refusal(Bool(), "true", "b")) == "b: expected true or false, got str"


def test_one_of_keeps_bools_and_numbers_apart():
    assert OneOf(("values", "shapes"))("shapes", "capture") == "shapes"
    assert str(refusal(OneOf(("values", "shapes")), "all", "capture")) == \
        "capture: 'all' is not one of 'values', 'shapes'"
    assert OneOf((0, 1))(1, "w") == 1
    assert str(refusal(OneOf((0, 1)), True)) == "w: 'True' is not one of 0, 1"  # True == 1, but not a number
    assert OneOf((True, False))(False, "w") is False
    assert str(refusal(OneOf((True, False)), 0)) == "w: '0' is not one of True, False"


def test_maybe_lets_null_through_and_checks_anything_else():
    maybe = Maybe(Int(1, 9))
    assert maybe(None, "w") is None and maybe(5, "w") == 5
    assert str(refusal(maybe, 0, "pad")) == "pad: 0 is outside [1, 9]"


def test_a_list_is_bounded_before_its_items_are_read_and_each_item_is_named():
    names = ListOf(Str(5), max_len=2)
    assert names([], "w") == () and names(["a", "b"], "w") == ("a", "b")
    assert str(refusal(names, ["a", "b", "c"], "tokens")) == "tokens: 3 entries, over the limit of 2 by 1"
    assert str(refusal(names, ["a", 7], "tokens")) == "tokens[1]: expected text, got int"
    assert str(refusal(names, ("a",), "tokens")) == "tokens: expected a list, got tuple"
    assert str(refusal(names, "ab", "tokens")) == "tokens: expected a list, got str"
    huge = [7] * 1000  # refused by its length: the first item (not text) is never read
    assert refusal(names, huge, "tokens").field == "tokens"


def test_a_tuple_has_exactly_its_entries_each_checked_by_its_own_rule():
    shape = TupleOf((Int(1, 9), Str(4)))
    assert shape([3, "abc"], "w") == (3, "abc")
    assert str(refusal(shape, [3], "shape")) == "shape: expected a list of 2 entries, got list of 1"
    assert str(refusal(shape, [3, "a", "b"], "shape")) == "shape: expected a list of 2 entries, got list of 3"
    assert str(refusal(shape, {"a": 1}, "shape")) == "shape: expected a list of 2 entries, got dict"
    assert str(refusal(shape, [3, 4], "shape")) == "shape[1]: expected text, got int"
    assert str(refusal(shape, [0, "a"], "shape")) == "shape[0]: 0 is outside [1, 9]"


def test_an_object_names_missing_and_unexpected_fields_by_their_path():
    step = Obj({"n": Int(1, 9), "t": Int(1, 9), "note": Str(9)}, optional=frozenset({"note"}))
    assert step({"n": 1, "t": 2}, "steps[0]") == {"n": 1, "t": 2}  # an optional field left out stays out
    assert step({"n": 1, "t": 2, "note": "x"}, "steps[0]") == {"n": 1, "t": 2, "note": "x"}
    missing = refusal(step, {"n": 1}, "steps[0]")
    assert str(missing) == "steps[0].t: missing" and missing.field == "steps[0].t"
    assert refusal(step, {"t": 1}, "").field == "n"  # at the top of a file, the field is its bare name
    assert str(refusal(step, {"n": 0, "t": 1}, "steps[0]")) == "steps[0].n: 0 is outside [1, 9]"
    note_first = Obj({"note": Str(9), "n": Int(1, 9)}, optional=frozenset({"note"}))
    assert str(refusal(note_first, {"n": 0}, "s")) == "s.n: 0 is outside [1, 9]"  # the rest is still checked
    assert str(refusal(note_first, {}, "s")) == "s.n: missing"
    extra = {"n": 1, "t": 1, "g": 0, "f": 0, "e": 0, "d": 0, "c": 0, "b": 0}
    assert str(refusal(step, extra, "steps[0]")) == "steps[0]: unexpected field(s) b, c, d, e, f"
    assert str(refusal(step, [1, 2], "steps[0]")) == "steps[0]: expected an object, got list"
    assert str(refusal(step, None, "steps[0]")) == "steps[0]: expected an object, got null"


def test_an_open_object_passes_other_fields_on_unchecked():
    head = Obj({"v": Int(1, 2)}, open=True)
    assert head({"v": 1, "extra": [None]}, "w") == {"v": 1, "extra": [None]}
    assert str(refusal(head, {"v": 3, "extra": 1})) == "w.v: 3 is outside [1, 2]"


def test_then_converts_what_passed_and_turns_a_conversion_error_into_a_refusal():
    assert Then(Int(0, 9), lambda v: v * 2)(4, "w") == 8
    assert str(refusal(Then(Str(9), int), "abc", "dtype")) == \
        "dtype: invalid literal for int() with base 10: 'abc'"

    def bad_type(_: object) -> None:
        raise TypeError("no such dtype")

    assert str(refusal(Then(Str(9), bad_type), "x", "dtype")) == "dtype: no such dtype"
    assert str(refusal(Then(Int(0, 9), bad_type), 10, "dtype")) == "dtype: 10 is outside [0, 9]"

    def other(_: object) -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):  # only a refusal of the value becomes a file error, not a bug in the code
        Then(Str(9), other)("x", "w")
