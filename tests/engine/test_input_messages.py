"""Engine input messages: ids given as Python lists are checked as given, and float64 values beyond float32's range
are named as such (not as a NaN or an infinity), without NumPy's RuntimeWarning."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from recall import Engine, InputError


@pytest.mark.parametrize("ids, needle", [
    ([1, "a", 2, 3], r"ids: row 1 holds 'a' \(str\); ids must all be integers like row 0$"),
    (["a", 1, "c", "d"], r"ids: row 1 holds 1 \(int\); ids must all be strings like row 0$"),
    ((1, 2, 3, "d"), r"ids: row 3 holds 'd' \(str\); ids must all be integers like row 0$"),
    ([True, False, 2, 3], r"ids: row 0 holds True \(bool\); ids must all be integers or strings$"),
    ([1, 2, True, 4], r"ids: row 2 holds True \(bool\); ids must all be integers like row 0$"),
    ([None, 1, 2, 3], r"ids: row 0 holds None \(NoneType\); ids must all be integers or strings$"),
])
def test_list_ids_are_checked_as_an_object_array_is(device, ids, needle):
    items = np.eye(4, dtype=np.float32)
    with pytest.raises(InputError, match=needle):
        Engine(items, ids=ids, device=device)
    # The same values as an object array: the same message.
    with pytest.raises(InputError, match=needle):
        Engine(items, ids=np.array(ids, dtype=object), device=device)


@pytest.mark.parametrize("ids, dtype", [
    ([10, 11, 12, 13], np.int64),
    ((10, np.int32(11), np.int64(12), 13), np.int64),
    (["a", "b", "c", "d"], object),
])
def test_list_ids_of_one_kind_still_work(device, ids, dtype):
    engine = Engine(np.eye(4, dtype=np.float32), ids=ids, device=device)
    assert engine.ids.dtype == dtype
    res = engine.search(np.array([[0, 0, 1, 0]], np.float32), 1)
    assert np.asarray(res.ids).tolist() == [[ids[2]]]


def _users_beyond_float32(row: int = 1) -> np.ndarray:
    users = np.ones((3, 4))
    users[row, 2] = 1e39  # finite in float64, inf in float32
    return users


@pytest.mark.parametrize("call", ["search", "search_async", "rescore", "check_users"])
def test_user_value_beyond_float32_is_named_so(device, call):
    engine = Engine(np.eye(4, dtype=np.float32), device=device)
    users = _users_beyond_float32()
    run = {"search": lambda: engine.search(users, 2),
           "search_async": lambda: engine.search_async(users, 2).result(),
           "rescore": lambda: engine.rescore(users, [np.array([0, 1])] * 3, 2),
           "check_users": lambda: engine.check_users(users)}[call]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's "overflow encountered in cast" must not leak
        with pytest.raises(InputError, match=r"^user_vecs: row 1 has a value beyond the float32 range$"):
            run()


def test_user_value_beyond_float32_in_a_list(device):
    engine = Engine(np.eye(4, dtype=np.float32), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match=r"^user_vecs: row 1 has a value beyond the float32 range$"):
            engine.search(_users_beyond_float32().tolist(), 2)


@pytest.mark.skipif(np.finfo(np.longdouble).max <= np.finfo(np.float64).max, reason="longdouble is float64 here")
def test_a_longdouble_beyond_float64_is_named_beyond_float32_not_infinite(device):
    """A longdouble value beyond float64's range (finite as given) was reported as "a NaN or infinite value"."""
    engine = Engine(np.eye(4, dtype=np.float32), device=device)
    users = np.ones((3, 4), np.longdouble)
    users[1, 2] = np.longdouble(1e308) * np.longdouble(1e10)
    assert np.isfinite(users).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match=r"^user_vecs: row 1 has a value beyond the float32 range$"):
            engine.search(users, 2)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_item_value_beyond_float32_is_named_so(device, metric):
    items = np.eye(8)
    items[6, 1] = -1e39
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match=r"^item_vecs: row 6 has a value beyond the float32 range$"):
            Engine(items, metric=metric, device=device)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_and_infinity_keep_their_message(device, bad, dtype):
    engine = Engine(np.eye(4, dtype=np.float32), device=device)
    users = np.ones((3, 4), dtype)
    users[2, 0] = bad
    with pytest.raises(InputError, match=r"^user_vecs: row 2 has a NaN or infinite value$"):
        engine.search(users, 2)
    with pytest.raises(InputError, match=r"^item_vecs: row 2 has a NaN or infinite value$"):
        Engine(users, device=device)


def test_the_first_bad_row_is_named(device):
    # A NaN before a value beyond float32's range, and the other way round: the first bad row, with its own reason.
    engine = Engine(np.eye(4, dtype=np.float32), device=device)
    users = _users_beyond_float32(row=2)
    users[1, 0] = np.nan
    with pytest.raises(InputError, match=r"row 1 has a NaN or infinite value"):
        engine.search(users, 2)
    users = _users_beyond_float32(row=0)
    users[1, 0] = np.nan
    with pytest.raises(InputError, match=r"row 0 has a value beyond the float32 range"):
        engine.search(users, 2)


def test_multi_interest_users_beyond_float32_are_named_as_such():
    items = np.random.default_rng(0).standard_normal((30, 4)).astype(np.float32)
    engine = Engine(items, device="cpu")
    users = np.ones((3, 2, 4))
    users[1, 1, 2] = 1e39
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning either
        with pytest.raises(InputError, match=r"user_vecs: user 1, interest 1 has a value beyond the float32 range"):
            engine.search(users, 3)
        with pytest.raises(InputError, match=r"user_vecs: user 1, interest 1 has a value beyond the float32 range"):
            engine.search([users[0], users[1], users[2]], 3)
    users[1, 1, 2] = np.nan
    with pytest.raises(InputError, match=r"user_vecs: user 1, interest 1 has a NaN or infinite value"):
        engine.search(users, 3)


def test_uint64_rows_beyond_int64_are_named_as_given():
    items = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    engine = Engine(items, device="cpu")
    users = np.ones((1, 3), np.float32)
    big = np.array([2**64 - 1], np.uint64)
    with pytest.raises(InputError, match=r"allow: item row 18446744073709551615 is out of range for 4 items"):
        engine.search(users, 2, allow=big)
    with pytest.raises(InputError, match=r"candidates: the list of user row 0 has item row 18446744073709551615 at "
                                         r"position 0, beyond any item row"):
        engine.rescore(users, [big], 2)


@pytest.mark.parametrize("flt", ["allow", "deny"])
def test_a_filter_of_more_than_one_dimension_is_refused(flt):
    # A (users, k) matrix of item rows passed by mistake was flattened into one filter for every user.
    engine = Engine(np.eye(6, dtype=np.float32), device="cpu")
    rows = np.array([[0, 1], [2, 3]])
    with pytest.raises(InputError, match=rf"{flt}: expected a 1-d array of item rows or an \(6,\) boolean mask, got "
                                         rf"shape \(2, 2\)"):
        engine.search(np.ones((1, 6), np.float32), 2, **{flt: rows})
    with pytest.raises(InputError, match=r"shape \(2, 2\)"):
        engine.set_item_filter(**{flt: rows})
