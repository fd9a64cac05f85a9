"""The credit algebra: pure functions over tensors (values -> segment rewards -> token advantages), normalisation, shared prefixes, the policy loss, first-error metrics."""
