import click
@click.group()
def main():
    pass
