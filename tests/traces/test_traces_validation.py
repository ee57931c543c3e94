"""Bad trace input: every refusal names the file, the row and the field; fixable problems are warnings."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import TraceError, TraceWarning, load_trace, save_trace, validate_trace
from traces.schema import canonical_trace

AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
T0, T1, T2 = "2023-11-16 18:15:46.6805900", "2023-11-16 18:15:50.9951690", "2023-11-16 18:15:51.2224670"
PL = "request_id,arrival_s,prompt_len,output_len\n"
MC = '{{"timestamp": {}, "input_length": {}, "output_length": {}, "hash_ids": {}}}\n'


def refused(tmp_path, name: str, text: str, **kw) -> str:
    """Write `text`, load it, and return the TraceError message (failing if it loads)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        load_trace(path, **kw)
    message = str(info.value)
    assert name in message
    return message


# (file name, content, where, field, problem)
CASES = [
    ("missing.csv", "TIMESTAMP,ContextTokens\n" + f"{T0},5\n", "line 1", "GeneratedTokens", "missing column"),
    ("nan.csv", AZ + f"{T0},5,6\n{T1},,6\n", "line 3", "ContextTokens", "missing value"),
    ("neg.csv", PL + "0,0.0,5,6\n1,0.5,-5,6\n2,1.0,5,6\n", "line 3", "prompt_len", "negative"),
    ("frac.csv", PL + "0,0.0,5,6\n1,0.5,5,6\n2,1.0,5,2.5\n", "line 4", "output_len", "fractional"),
    ("zero.csv", AZ + f"{T0},5,6\n{T1},5,0\n", "line 3", "GeneratedTokens", "zero output length"),
    ("zero_prompt.csv", PL + "0,0.0,0,6\n", "line 2", "prompt_len", "zero prompt length"),
    ("text.csv", PL + "0,0.0,5,6\n1,0.5,many,6\n", "line 3", "prompt_len", "not a number"),
    ("stamp.csv", AZ + f"{T0},5,6\nyesterday,5,6\n", "line 3", "TIMESTAMP", "not a timestamp"),
    ("negtime.csv", PL + "0,0.0,5,6\n1,-1.0,5,6\n", "line 3", "arrival_s", "negative arrival"),
    ("inf.csv", PL + "0,0.0,5,6\n1,inf,5,6\n", "line 3", "arrival_s", "value is not finite: inf"),
    ("late.csv", PL + "0,0.0,5,6\n1,2e9,5,6\n", "line 3", "arrival_s", "is past 1e+09 s"),
    ("twice.csv", PL.strip() + ",prompt_len\n0,0.0,5,6,3\n", "line 1 (header)", None,
     "column 'prompt_len' appears twice"),
    ("neginf.csv", PL + "0,0.0,5,6\n1,0.5,-inf,6\n", "line 3", "prompt_len", "value is not finite: -inf"),
    ("dup.csv", PL + "3,0.0,5,6\n4,0.5,5,6\n3,1.0,5,6\n", "line 4", "request_id", "first used at line 2"),
    ("zero_n.csv", "arrival_s,prompt_len,output_len,n\n0,5,6,1\n1,5,6,0\n", "line 3", "n",
     "below the minimum"),
    ("mc.jsonl", MC.format(0, 5, 6, "[1]") + '{"timestamp": 3, "input_length": 5}\n',
     "line 2", "output_length", "missing value"),
    ("mcneg.jsonl", MC.format(0, 5, 6, "[1]") + MC.format(1, -4, 6, "[1]"), "line 2", "input_length",
     "negative"),
    ("badjson.jsonl", MC.format(0, 5, 6, "[1]") + '{"timestamp": 1,\n', "line 2", None, "not valid JSON"),
    ("keys.jsonl", MC.format(0, 5, 6, '["a"]'), "line 1", "hash_ids", "not an integer key"),
    ("toomany.jsonl", MC.format(0, 5, 6, "[1, 2]"), "line 1", "hash_ids", "spans only 1 block"),
    ("nosize.csv", "arrival_s,prompt_len,output_len,prefix_blocks\n0,5,6,1 2\n", "line 1",
     "prefix_block_size", "missing column"),
    ("burst_neg.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "1,m,5,6,11,x\n2,m,5,-1,4,x\n", "line 3", "Response tokens", "negative"),
    ("clock.csv", PL + "0,2024-01-01 00:00:00,5,6\n", "line 2", "arrival_s", "(expected seconds"),
    # Prefix keys are int64 in every table and array: a wider one is refused where the trace is read.
    ("bigkey.csv", PL.strip() + ",prefix_blocks,prefix_block_size\n0,0,40,5,99999999999999999999999 2,16\n",
     "line 2", "prefix_blocks", "key 99999999999999999999999 is outside the signed 64-bit range"),
    ("bigkey.jsonl", MC.format(0, 1024, 5, "[1, 18446744073709551616]"), "line 1", "hash_ids",
     "key 18446744073709551616 is outside"),
]


@pytest.mark.parametrize(("name", "text", "where", "field", "problem"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_file_row_and_field(tmp_path, name, text, where, field, problem):
    message = refused(tmp_path, name, text)
    assert f"{where}" in message
    if field is not None:
        assert f"'{field}'" in message
    assert problem in message


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("empty.csv", "", "empty file"),
    ("spaces.jsonl", "\n\n  \n", "empty file"),
    ("header.csv", AZ, "no requests"),
    ("odd.csv", "foo,bar\n1,2\n", "unknown trace format"),
    ("odd.jsonl", '{"foo": 1}\n', "unknown trace format"),
])
def test_empty_and_unknown_files_are_refused(tmp_path, name, text, problem):
    assert problem in refused(tmp_path, name, text)


def test_unknown_format_name_and_missing_file(tmp_path):
    path = tmp_path / "ok.csv"
    path.write_text(PL + "0,0.0,5,6\n")
    with pytest.raises(TraceError, match="unknown format 'xml'"):
        load_trace(path, format="xml")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "absent.csv")


def test_binary_garbage_is_an_unknown_format(tmp_path):
    path = tmp_path / "x.dat"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(path)


def test_unsorted_arrivals_are_sorted_stably_with_a_warning(tmp_path):
    path = tmp_path / "unsorted.csv"
    path.write_text(AZ + f"{T1},1,1\n{T0},2,1\n{T2},3,1\n{T0},4,1\n")
    warnings: list[str] = []
    df = load_trace(path, warnings=warnings)
    assert df["prompt_len"].tolist() == [2, 4, 1, 3]  # ties keep file order
    assert df["request_id"].tolist() == [1, 3, 0, 2]  # ids follow the file's order
    assert df["arrival_s"].is_monotonic_increasing and df["arrival_s"].iloc[0] == 0.0
    assert len(warnings) == 1 and "unsorted.csv" in warnings[0] and "line 3" in warnings[0]


def test_warnings_become_python_warnings_without_a_list(tmp_path):
    path = tmp_path / "late.csv"
    path.write_text(PL + "0,5.0,5,6\n1,6.0,5,6\n")
    with pytest.warns(TraceWarning, match="shifted by -5"):
        df = load_trace(path)
    assert df["arrival_s"].tolist() == [0.0, 1.0]


def test_blank_lines_are_skipped_but_line_numbers_stay_true(tmp_path):
    message = refused(tmp_path, "gaps.csv", PL + "0,0.0,5,6\n\n\n1,0.5,5,0\n")
    assert "line 5" in message


def test_rows_wider_than_the_header_are_refused_not_shifted(tmp_path):
    # Every row one value too many: pandas would take the first column for an index and shift the rest.
    assert "wide.csv line 2: 5 fields, but the header names 4" in refused(tmp_path, "wide.csv",
                                                                           PL + "0,0.0,5,6,7\n1,0.5,5,6,7\n")
    # A comma at the end of every line leaves an empty field: dropped.
    (tmp_path / "trailing.csv").write_text(PL + "0,0.0,5,6,\n1,0.5,7,8,\n")
    df = load_trace(tmp_path / "trailing.csv", warnings=[])
    assert df["prompt_len"].tolist() == [5, 7] and df["output_len"].tolist() == [6, 8]


def test_a_json_format_without_its_keys_says_which_are_missing(tmp_path):
    (tmp_path / "ours.jsonl").write_text('{"request_id":0,"arrival_s":0,"prompt_len":10,"output_len":5}\n')
    with pytest.raises(TraceError, match=r"ours.jsonl line 1, field .*'timestamp'.*: missing column"):
        load_trace(tmp_path / "ours.jsonl", "mooncake", warnings=[])


def test_a_missing_column_lists_the_columns_found_even_unknown_ones(tmp_path):
    path = tmp_path / "other.parquet"
    pd.DataFrame({"a": [1, 2], "b": [3, 4]}).to_parquet(path)
    with pytest.raises(TraceError, match=r"missing column \(found: a, b\)"):
        load_trace(path, warnings=[])


def test_parquet_rows_are_named_by_data_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pd.DataFrame({"arrival_s": [0.0, 1.0, 2.0], "prompt_len": [3, 4, 5],
                  "output_len": [1, 0, 2]}).to_parquet(path)
    with pytest.raises(TraceError, match=r"bad\.parquet row 2, field 'output_len': zero output length"):
        load_trace(path)


@pytest.mark.parametrize("stamps", [pd.to_datetime(["2024-01-01 00:00:00", "2024-01-01 00:00:01"]),
                                    pd.to_timedelta([0, 1], unit="s")], ids=["datetime", "timedelta"])
def test_a_parquet_clock_column_is_refused_not_read_as_seconds(tmp_path, stamps):
    path = tmp_path / "clock.parquet"
    pd.DataFrame({"arrival_s": stamps, "prompt_len": [5, 6], "output_len": [3, 3]}).to_parquet(path)
    with pytest.raises(TraceError, match=r"clock.parquet row 1, field 'arrival_s': a \w+64\[\w+\] column is "
                                         r"not numbers \(expected seconds"):
        load_trace(path)


def test_keys_at_the_ends_of_int64_load():
    df = validate_trace(pd.DataFrame({"arrival_s": [0.0], "prompt_len": [32], "output_len": [1],
                                      "prefix_blocks": [[-(2**63), 2**63 - 1]], "prefix_block_size": [16]}))
    assert df["prefix_blocks"][0] == [-(2**63), 2**63 - 1]


def test_validate_trace_on_a_frame():
    df = pd.DataFrame({"arrival_s": [0.0, 1.0], "prompt_len": [3, 4.5], "output_len": [1, 2]})
    with pytest.raises(TraceError, match=r"mine row 2, field 'prompt_len': fractional value 4.5"):
        validate_trace(df, source="mine")
    with pytest.raises(TraceError, match="missing column"):
        validate_trace(df.drop(columns="output_len"))
    with pytest.raises(TraceError, match="no requests"):
        validate_trace(df.iloc[:0])


def test_validate_trace_returns_a_canonical_copy():
    df = pd.DataFrame({"output_len": np.array([2, 3], np.int32), "prompt_len": [7.0, 8.0],
                       "arrival_s": [0, 2]}, index=[10, 11])
    out = validate_trace(df)
    assert list(out.columns) == ["request_id", "arrival_s", "prompt_len", "output_len", "n", "beam_width"]
    assert out.dtypes.astype(str).tolist() == ["int64", "float64", "int64", "int64", "int64", "int64"]
    assert out.index.tolist() == [0, 1]
    out.loc[0, "prompt_len"] = 99
    assert df["prompt_len"].iloc[0] == 7.0



def _frame(arrival, prompt, output, ids):
    n = len(arrival)
    data = {"request_id": ids, "arrival_s": arrival, "prompt_len": prompt, "output_len": output,
            "n": [1] * n, "beam_width": [1] * n}
    return pd.DataFrame({c: np.asarray(v, np.float64 if c == "arrival_s" else np.int64)
                         for c, v in data.items()})


@pytest.mark.filterwarnings("ignore::traces.TraceWarning")  # shifted/sorted arrivals: fixed, as it should
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([-1.0, 0.0, 0.5, 2.0, float("nan")]), st.integers(-1, 3),
                          st.integers(-1, 3), st.integers(0, 6)), min_size=1, max_size=6))
def test_canonical_trace_returns_what_validation_returns(rows):
    arrival, prompt, output, ids = (list(c) for c in zip(*rows, strict=True))
    df = _frame(arrival, prompt, output, ids)
    try:
        checked = validate_trace(df)
    except TraceError as exc:
        with pytest.raises(TraceError) as info:
            canonical_trace(df)
        assert str(info.value) == str(exc)
        return
    out = canonical_trace(df)
    pd.testing.assert_frame_equal(out, checked, check_exact=True)
    if out is df:  # no copy only where validation changes nothing, index included
        assert df.index.equals(checked.index)
    if (np.diff(checked["request_id"]) > 0).all():  # increasing ids: a validated trace is not copied again
        assert canonical_trace(checked) is checked


@pytest.mark.filterwarnings("ignore::traces.TraceWarning")
def test_canonical_trace_skips_the_copy_for_a_validated_trace():
    df = validate_trace(_frame([0.0, 1.0, 1.0], [3, 4, 5], [1, 2, 3], [0, 1, 2]))
    assert canonical_trace(df) is df
    assert canonical_trace(df.iloc[1:]) is not df.iloc[1:]  # index 1.., arrivals not from 0: checked in full


def test_save_refuses_unknown_extension_and_bad_frames(tmp_path):
    good = pd.DataFrame({"arrival_s": [0.0], "prompt_len": [3], "output_len": [1]})
    with pytest.raises(TraceError, match="use .csv, .jsonl or .parquet"):
        save_trace(good, tmp_path / "t.xlsx")
    with pytest.raises(TraceError, match="zero output length"):
        save_trace(good.assign(output_len=0), tmp_path / "t.csv")
    assert list(tmp_path.iterdir()) == []


def test_os_errors_become_trace_errors(tmp_path):
    good = pd.DataFrame({"arrival_s": [0.0], "prompt_len": [3], "output_len": [1]})
    (tmp_path / "taken.csv").mkdir()
    with pytest.raises(TraceError, match=r"taken\.csv: cannot write the file"):
        save_trace(good, tmp_path / "taken.csv")
    assert [p.name for p in tmp_path.iterdir()] == ["taken.csv"]  # the temporary file is gone
    with pytest.raises(TraceError, match="is a folder"):
        load_trace(tmp_path / "taken.csv")


@pytest.mark.parametrize("dtype", ["Int64", "Float64"])
def test_a_missing_value_in_a_nullable_column_is_named(dtype):
    df = pd.DataFrame({"request_id": [0, 1, 2], "arrival_s": [0.0, 0.5, 1.0], "prompt_len": [10, 20, 30],
                       "output_len": pd.array([5, None, 7], dtype=dtype)})
    with pytest.raises(TraceError, match=r"row 2, field 'output_len': missing value"):
        validate_trace(df)
