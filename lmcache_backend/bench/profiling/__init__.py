"""One vLLM engine, measured: where a blended request's time goes, time to first token
against full prefill, a decode stream while another prompt blends, the paged attention
of the selected queries."""
