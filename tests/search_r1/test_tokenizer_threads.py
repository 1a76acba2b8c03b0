"""The plugin's tokenizer loads safely from several threads at once (the asynchronous rollout stream and an evaluation
start together): the first `from transformers import AutoTokenizer` of concurrent threads can otherwise fail inside
transformers' lazy module."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

PROGRAM = """
import sys, threading
from slime_search.search_r1.generate import load_tokenizer
errors, loaded = [], []
def load():
    try:
        loaded.append(load_tokenizer(sys.argv[1]))
    except Exception as err:
        errors.append(repr(err))
threads = [threading.Thread(target=load) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not errors, errors
assert len(loaded) == 8 and len({id(t) for t in loaded}) == 1
"""


def test_eight_threads_load_the_tokenizer_in_a_fresh_interpreter(tiny_checkpoint):
    for _ in range(3):  # each run imports transformers anew, from eight threads at once
        done = subprocess.run([sys.executable, "-c", PROGRAM, str(tiny_checkpoint)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
