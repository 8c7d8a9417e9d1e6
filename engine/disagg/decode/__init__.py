"""The decode side of disaggregation: the `kv_transfer` hook and its `PrefillClient`
protocol, the in-process transfer backend, the remote prefill client and its links,
and where received KV lands."""
