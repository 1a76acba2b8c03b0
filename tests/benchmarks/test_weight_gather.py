"""The weight gather benchmark at its smallest size: a one-layer model, both ways measured in their own process."""

import pytest

from benchmarks.perf.weight_gather import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SMALLEST = ["--hidden-size", "64", "--num-layers", "1", "--num-heads", "4", "--num-kv-heads", "2"]
SMALLEST += ["--intermediate-size", "128", "--bucket-mb", "4"]


def test_both_ways_go_through_the_whole_model_and_print_their_figures(capsys):
    assert main(SMALLEST) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(rows) == {"whole", "streamed"}
    whole, streamed = rows["whole"], rows["streamed"]
    assert whole[0] == streamed[0] and float(whole[0]) > 0  # the same model, GiB
    assert int(whole[2]) >= 2 and int(streamed[2]) >= 2  # cut into buckets of 4 MB
    assert all(float(row[3]) > 0 for row in (whole, streamed))  # seconds
