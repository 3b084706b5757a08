"Run by tests/test_fsdp.py under torchrun: nanorl.train (DDP) with every pass running each row's prompt itself."

import sys

import nanorl.train as T

share_prompt_once = T.token_logp
T.token_logp = lambda model, inputs, targets, share_prefix=True, **kw: share_prompt_once(
    model, inputs, targets, share_prefix=False, **kw
)  # as --fsdp runs its passes

if __name__ == "__main__":
    T.main(sys.argv[1:])
