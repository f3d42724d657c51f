"""``offload serve``'s server: the OpenAI wire format (``protocol``), the model worker
(``engine``), stop strings (``stops``), Prometheus counters (``metrics``) and the Starlette
app (``app``). Imported only by the serve command, so ``import offload`` stays light."""
