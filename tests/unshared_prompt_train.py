"Run by tests/test_fsdp.py under torchrun: nanorl.train (DDP or --fsdp), every pass running each row's prompt itself."

import sys

import nanorl.step as S
import nanorl.train as T
from nanorl.loss import token_logp

S.shared_token_logp = token_logp  # the plain path: every row runs its own prompt

if __name__ == "__main__":
    T.main(sys.argv[1:])
