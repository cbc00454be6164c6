def rewrite_attention(ctx):
    pass
