"""Data: teacher trajectories and the training states drawn from them (Eq. 3-5, :mod:`tdlm.data.trajectories`), the
trajectory store written by generation and read by training (:mod:`tdlm.data.store`, :mod:`tdlm.data.stream`), the
tokenizer, prompt sources, and the contamination checks that keep evaluation problems out of training."""
