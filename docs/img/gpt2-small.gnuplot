# gnuplot docs/img/gpt2-small.gnuplot (from docs/img): the loss curve of the 124M GPT-2 run
# of docs/benchmarks.md, from gpt2-small.csv.
set terminal pngcairo size 800,450
set output 'gpt2-small.png'
set datafile separator ','
set title 'gpt2-small (GPT-2 124M, untied head) on Debian license texts, bytes, 2 CPU ranks (DDP)'
set xlabel 'step (512 tokens each)'
set ylabel 'training loss (per-token cross entropy)'
set grid
set key off
plot 'gpt2-small.csv' skip 1 using 1:2 with lines lw 2
