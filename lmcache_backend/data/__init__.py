"""The data the package ships: the built-in RAG examples, the dev set and the embedded model."""
