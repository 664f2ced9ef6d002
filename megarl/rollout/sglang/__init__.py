"""The SGLang rollout engine (GPU clusters; verified only on GPUs with SGLang, its request building
on CPU): `engine.SGLangEngine` drives a colocated `sglang.Engine` per `rollout_tp` ranks;
`requests` holds the pure logic it needs (server arguments, request and sampling dicts, output
parsing, weight buckets, owner-rank gathering), which never imports sglang."""
