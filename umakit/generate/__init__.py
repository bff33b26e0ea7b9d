"""Generation above the engines: sampling, the decode loop, batching, chat and speculative decoding.

- `sampling`: `SamplingParams` and the sampler's rules, written once over a small array interface that each
  engine (and speculative decoding, in numpy) gives its own arrays; the one module here engines may import;
- `options`: the generation options `umakit.Model`'s methods and the batch functions declare, once;
- `stream`: a token stream turned into text: stop strings, statistics, `stream_generate`, `collect`;
- `batch`: many prompts decoded together (continuous batching on an engine's `BatchDecoder`), and
  `batch_io`, batch jobs as JSON Lines;
- `chat`: multi-turn chat with the KV cache kept across turns;
- `speculative/`: speculative decoding, one more user of the engine protocol.

Everything but `sampling` sits above the engines and reaches them only through the protocol
(`umakit.backends.base`); it imports `core`, `checkpoint` (the tokenizer), `plan` (the roofline) and
`hardware`, never an engine's package.
"""
