"""The checks that stop a run from failing silently, each a plain module tested without a Trainer
and wrapped by one callback in ``bnlit.callbacks``: gradient flow (the arbiter), the NaN/spike
guard, tokenizer fertility, language starvation and dead vocabulary."""
