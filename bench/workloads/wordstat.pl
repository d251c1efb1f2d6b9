#!/usr/bin/perl
# CPU-bound Perl workload of the dbr benchmark suite: tokenises the generated text
# input with regexes, counts words and bigrams in hashes, sums the numeric CSV
# fields, sorts, and prints a deterministic summary.  usage: perl wordstat.pl FILE ROUNDS
use strict;
use warnings;

my ($file, $rounds) = @ARGV;
$rounds ||= 1;
open(my $fh, '<', $file) or die "$file: $!";
my @lines = <$fh>;
close $fh;

my (%words, %bigrams, $num_sum, $log_ms);
for my $r (1 .. $rounds) {
    for my $line (@lines) {
        if ($line =~ /^(\d+),(\w+),(\d+),([\d.]+)$/) {
            $num_sum += $3 + $r;
            $words{$2}++;
        } elsif ($line =~ /took (\d+)ms$/) {
            $log_ms += $1;
        } elsif ($line =~ /^[0-9a-f]+$/) {
            $num_sum += length($line);
        } else {
            my $prev = '';
            for my $w (split /[\s.]+/, lc $line) {
                next unless length $w;
                $words{$w}++;
                $bigrams{"$prev $w"}++ if $prev ne '';
                $prev = $w;
            }
        }
    }
}
my @top = (sort { $words{$b} <=> $words{$a} || $a cmp $b } keys %words)[0 .. 19];
my @topb = (sort { $bigrams{$b} <=> $bigrams{$a} || $a cmp $b } keys %bigrams)[0 .. 9];
print "words ", scalar(keys %words), " bigrams ", scalar(keys %bigrams), "\n";
print "num_sum $num_sum log_ms $log_ms\n";
print "$_ $words{$_}\n" for @top;
print "$_ $bigrams{$_}\n" for @topb;
