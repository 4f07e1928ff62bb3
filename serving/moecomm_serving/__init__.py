"""moecomm_serving: the reference serving layer (CLI, model, HTTP front end)."""
