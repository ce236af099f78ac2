"""The book's helpers: what the chapters measure and show, on top of the runtime. Checkpoint inventory
(`inventory`), the conversion mistakes of chapter 2 (`mistakes`), text quality and acceptance (`evaluate`,
`quality`), the cost model of chapter 6 (`throughput`), the benchmarks behind `python -m qmtp bench`
(`bench`, `bench_convert`, `peer`), saved results and the claims checked against them (`results`, `claims`),
figures and the draft explorer (`plots`, `widgets`). Nothing in the runtime imports these."""
