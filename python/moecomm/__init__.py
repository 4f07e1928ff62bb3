"""moecomm: communication and kernels for Mixture-of-Experts serving with disaggregated experts."""
