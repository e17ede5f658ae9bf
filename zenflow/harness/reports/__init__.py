"""Tables, figures and the claims table, made from run records only."""
