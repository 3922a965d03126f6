"""Implementation modules behind the public `tutel.moe` facade."""
