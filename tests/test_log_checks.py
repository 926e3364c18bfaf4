"""OUR_TRACEBACK: a frame of this repository's code is ours; a frame of its venv's scripts is not, even in a clone
whose folder is named ``tdlm`` (a clean-clone CI run there once failed two training tests on deepspeed's frame)."""

from tests.log_checks import OUR_TRACEBACK, REPO


def test_our_frames_match_and_the_venvs_do_not():
    assert OUR_TRACEBACK.search(f'  File "{REPO}/launcher/train.py", line 40, in <module>')
    assert OUR_TRACEBACK.search(f'  File "{REPO}/tdlm/training/loop.py", line 9, in run')
    assert not OUR_TRACEBACK.search(f'  File "{REPO}/.venv/bin/deepspeed", line 6, in <module>')
    assert not OUR_TRACEBACK.search(f'  File "{REPO}/.venv/lib/python3.11/site-packages/tdlm_other/x.py"')
    assert not OUR_TRACEBACK.search('  File "/elsewhere/tdlm/tdlm/x.py", line 1')  # another checkout is not this one
