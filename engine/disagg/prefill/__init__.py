"""The prefill side of disaggregation: the prefill server, its side of each link,
and the in-process prefill worker."""
