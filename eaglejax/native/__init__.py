"""Native CPU kernels that XLA:CPU lacks, built from C++ on first use and called through
the XLA FFI (see `few_row_matmul`). Without a C++ compiler the XLA paths are used."""
