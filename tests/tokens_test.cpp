// Token files (tokens.h): text to token files and back, the windows the trainer reads (shifted
// by one, repeatable by seed and index, strided over the whole file), the files refused with
// their path named, and `scaletrain data text`.

#include "scaletrain/tokens.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "scaletrain/checkpoint.h"
#include "scaletrain/error.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "zoo_models.h"

namespace scaletrain {
namespace {

namespace fs = std::filesystem;
using testing::cli_path;
using testing::run_command;

using testing::TempDir;

void write_file(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

// Text with every byte value in it, UTF-8 included, and no window repeated.
std::string sample_text(size_t n) {
  std::string s = "Ünïcödé — ";
  for (int b = 0; b < 256; ++b) s += static_cast<char>(b);
  for (size_t i = 0; s.size() < n; ++i) s += "line " + std::to_string(i * 7919 % 1000) + ".\n";
  s.resize(n);
  return s;
}

// Expects `f` to throw UsageError whose message holds every one of `parts`.
template <typename F>
void expect_usage_error(F f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no UsageError";
  } catch (const UsageError& e) {
    for (const auto& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
}

at::Tensor tokens_of(const TokenFile& f) { return f.window(0, f.size()); }

TEST(Tokens, TextRoundTripsThroughTokenFiles) {
  TempDir dir("tokens_roundtrip");
  const std::string text = sample_text(5000);
  write_file(dir.path / "in.txt", text);
  const auto r =
      write_byte_tokens((dir.path / "in.txt").string(), (dir.path / "out").string(), 0.1);
  EXPECT_EQ(r.train_tokens, 4500);  // floor(5000 * 0.9), nanoGPT's split
  EXPECT_EQ(r.val_tokens, 500);
  EXPECT_EQ(r.files, 1);
  TokenFile train(r.train_path), val(r.val_path);
  EXPECT_EQ(fs::file_size(r.train_path), 2 * 4500u);  // uint16 ids, nothing else
  EXPECT_EQ(train.size(), 4500);
  EXPECT_EQ(train.at(0), static_cast<unsigned char>(text[0]));
  EXPECT_EQ(decode_bytes(tokens_of(train)) + decode_bytes(tokens_of(val)), text);
  // Only the two files are left: the temporaries were renamed.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path / "out"), fs::directory_iterator()), 2);
}

TEST(Tokens, WindowsAreTheFileShiftedByOne) {
  TempDir dir("tokens_shift");
  write_file(dir.path / "in.txt", sample_text(3000));
  const auto r = write_byte_tokens((dir.path / "in.txt").string(), dir.path.string(), 0.5);
  TokenFile file(r.train_path);
  TokenWindowOptions o;
  o.block_size = 16;
  auto source = token_windows(r.train_path, o);
  EXPECT_EQ(source.size, (1500 - 1) / 16);
  const Batch b = source.batch({0, 5, 9, 40}, 0);
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{4, 16}));
  ASSERT_EQ(b.targets.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_EQ(b.inputs.scalar_type(), at::kLong);
  EXPECT_EQ(b.targets.scalar_type(), at::kLong);
  const at::Tensor all = tokens_of(file);
  for (int64_t row = 0; row < 4; ++row) {
    // x is the file at some start, y the same window one token on.
    int64_t found = -1;
    for (int64_t s = 0; s + 16 < file.size() && found < 0; ++s) {
      if (at::equal(all.narrow(0, s, 16), b.inputs[row])) found = s;
    }
    ASSERT_GE(found, 0) << "row " << row << " is no window of the file";
    EXPECT_TRUE(at::equal(file.window(found + 1, 16), b.targets[row])) << "row " << row;
  }
}

TEST(Tokens, RandomWindowsDependOnSeedAndIndexAlone) {
  TempDir dir("tokens_random");
  // Token t is t: a window's first token is its start.
  std::vector<uint16_t> ids(4000);
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<uint16_t>(t);
  const std::string path = (dir.path / "ids.bin").string();
  write_file(path, std::string(reinterpret_cast<const char*>(ids.data()), 2 * ids.size()));
  TokenWindowOptions o;
  o.block_size = 8;
  o.seed = 3;
  auto a = token_windows(path, o);
  auto again = token_windows(path, o);
  ASSERT_EQ(a.size, 499);  // (4000 - 1) / 8
  // A sample is the same in any batch, at any place in it, whatever the loader's seed: any rank
  // of any world size, and a resumed run, read the same windows.
  const Batch together = a.batch({7, 2, 30}, 11);
  EXPECT_TRUE(at::equal(together.inputs[0], again.batch({7}, 99).inputs[0]));
  EXPECT_TRUE(at::equal(together.inputs[1], again.batch({30, 2}, 0).inputs[1]));
  EXPECT_TRUE(at::equal(together.targets[2], a.batch({30}, 5).targets[0]));
  // The starts spread over the 3992 possible ones, and another seed draws others.
  std::vector<int64_t> all(static_cast<size_t>(a.size));
  for (int64_t i = 0; i < a.size; ++i) all[static_cast<size_t>(i)] = i;
  const at::Tensor starts = a.batch(all, 0).inputs.select(1, 0).contiguous();
  EXPECT_LT(starts.min().item<int64_t>(), 100);
  EXPECT_GT(starts.max().item<int64_t>(), 3992 - 100);
  EXPECT_LE(starts.max().item<int64_t>(), 3991);  // the last window's next token fits
  // 499 draws of 3992: about 3992 (1 - e^(-499/3992)) = 469 distinct on average.
  std::set<int64_t> distinct(starts.data_ptr<int64_t>(), starts.data_ptr<int64_t>() + a.size);
  EXPECT_GT(distinct.size(), 440u);
  o.seed = 4;
  const at::Tensor other = token_windows(path, o).batch(all, 0).inputs.select(1, 0);
  EXPECT_LT(at::eq(starts, other).sum().item<int64_t>(), 5);
}

TEST(Tokens, StridedWindowsCoverTheFile) {
  TempDir dir("tokens_strided");
  write_file(dir.path / "in.txt", sample_text(1001));
  const auto r = write_byte_tokens((dir.path / "in.txt").string(), dir.path.string(), 0.1);
  TokenFile file(r.train_path);  // 900 tokens
  TokenWindowOptions o;
  o.mode = TokenWindowOptions::Mode::kStrided;
  o.block_size = 10;
  auto s = token_windows(r.train_path, o);
  ASSERT_EQ(s.size, (900 - 1) / 10);  // 89: the 90th window would have no next token
  std::vector<int64_t> all;
  for (int64_t i = 0; i < s.size; ++i) all.push_back(i);
  const Batch b = s.batch(all, 0);
  EXPECT_TRUE(at::equal(b.inputs.reshape({-1}), file.window(0, 890)));
  EXPECT_TRUE(at::equal(b.targets.reshape({-1}), file.window(1, 890)));
  o.samples = 5;  // the first five
  EXPECT_EQ(token_windows(r.train_path, o).size, 5);
  o.samples = 90;
  expect_usage_error([&] { token_windows(r.train_path, o); }, {r.train_path, "89 strided"});
}

TEST(Tokens, BadFilesAreRefusedNamingThePath) {
  TempDir dir("tokens_bad");
  const std::string missing = (dir.path / "no_such.bin").string();
  expect_usage_error([&] { TokenFile f(missing); }, {missing, "scaletrain data text"});
  const std::string empty = (dir.path / "empty.bin").string();
  write_file(empty, "");
  expect_usage_error([&] { TokenFile f(empty); }, {empty, "is empty"});
  const std::string odd = (dir.path / "odd.bin").string();
  write_file(odd, "abc");
  expect_usage_error([&] { TokenFile f(odd); }, {odd, "3 bytes, an odd count"});
  expect_usage_error([&] { TokenFile f(dir.path.string()); }, {dir.path.string(), "regular"});
  const std::string short_file = (dir.path / "short.bin").string();
  write_file(short_file, std::string(2 * 16, 'a'));  // 16 tokens
  TokenWindowOptions o;
  o.block_size = 16;  // needs 17
  expect_usage_error([&] { token_windows(short_file, o); }, {short_file, "holds 16 tokens"});
  o.block_size = 15;
  EXPECT_EQ(token_windows(short_file, o).size, 1);
  o.block_size = 0;
  expect_usage_error([&] { token_windows(short_file, o); }, {"block_size 0"});
  TokenFile f(short_file);
  EXPECT_THROW(f.window(10, 7), Error);
  EXPECT_THROW(f.at(16), Error);
}

// llm.c's shards: a header of 256 int32 (magic, version, count), then the uint16 ids.
TEST(Tokens, ReadsLlmcShards) {
  TempDir dir("tokens_llmc");
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = 4;
  const std::vector<uint16_t> ids{50256, 15496, 11, 995};
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(ids.data()), 8);
  write_file(dir.path / "shard.bin", bytes);
  TokenFile f((dir.path / "shard.bin").string());
  EXPECT_EQ(f.size(), 4);
  EXPECT_EQ(f.at(0), 50256);
  EXPECT_EQ(f.at(3), 995);
  header[1] = 2;  // LLaMA 3's uint32 ids
  write_file(dir.path / "v2.bin", std::string(reinterpret_cast<const char*>(header.data()), 1024) +
                                      std::string(16, '\0'));
  expect_usage_error([&] { TokenFile g((dir.path / "v2.bin").string()); }, {"v2.bin", "version 2"});
}

// llm.c's shards for Llama 3's vocabulary of 128,256: magic 20240801, version 7, uint32 ids. The
// windows read ids past 65535, and the vocabulary check names one past the model's.
TEST(Tokens, ReadsLlmcShardsOfUint32Ids) {
  TempDir dir("tokens_llmc32");
  std::vector<int32_t> header(256, 0);
  header[0] = 20240801;
  header[1] = 7;
  header[2] = 5;
  const std::vector<uint32_t> ids{128000, 9906, 11, 1917, 128255};
  const std::string head(reinterpret_cast<const char*>(header.data()), 1024);
  write_file(dir.path / "shard.bin",
             head + std::string(reinterpret_cast<const char*>(ids.data()), 20));
  const std::string path = (dir.path / "shard.bin").string();
  TokenFile f(path);
  EXPECT_EQ(f.size(), 5);
  EXPECT_EQ(f.id_bytes(), 4);
  EXPECT_EQ(f.at(0), 128000u);
  EXPECT_EQ(f.at(4), 128255u);
  EXPECT_TRUE(at::equal(f.window(1, 3), at::tensor({9906, 11, 1917}, at::kLong)));
  TokenWindowOptions o;
  o.block_size = 4;
  o.mode = TokenWindowOptions::Mode::kStrided;
  o.vocab_size = 128256;
  const Batch b = token_windows(path, o).batch({0}, 0);
  EXPECT_TRUE(at::equal(b.inputs[0], at::tensor({128000, 9906, 11, 1917}, at::kLong)));
  EXPECT_TRUE(at::equal(b.targets[0], at::tensor({9906, 11, 1917, 128255}, at::kLong)));
  o.vocab_size = 128255;  // one short: the last target is out of it
  expect_usage_error([&] { token_windows(path, o).batch({0}, 0); },
                     {path, "holds id 128255 at token 4", "at least 128256"});
  header[2] = 6;  // counts one more id than the file holds
  write_file(dir.path / "short.bin",
             std::string(reinterpret_cast<const char*>(header.data()), 1024) +
                 std::string(reinterpret_cast<const char*>(ids.data()), 20));
  expect_usage_error([&] { TokenFile g((dir.path / "short.bin").string()); },
                     {"short.bin", "6 tokens of 4 bytes"});
  header[1] = 2;
  write_file(dir.path / "v2.bin", std::string(reinterpret_cast<const char*>(header.data()), 1024) +
                                      std::string(24, '\0'));
  expect_usage_error([&] { TokenFile g((dir.path / "v2.bin").string()); },
                     {"v2.bin", "version 2", "20240801 version 7"});
}

TEST(Tokens, FolderIsReadInPathOrderWithoutTheOutputFolder) {
  TempDir dir("tokens_folder");
  write_file(dir.path / "text" / "b.txt", "BBBB");
  write_file(dir.path / "text" / "a.txt", "AAAA");
  write_file(dir.path / "text" / "sub" / "c.txt", "CCCC");
  write_file(dir.path / "text" / "a0.txt", "0000");
  const std::string out = (dir.path / "text" / "tokens").string() + "/";
  for (int run = 0; run < 2; ++run) {  // the second run must not read the first one's files
    const auto r = write_byte_tokens((dir.path / "text").string(), out, 0.25);
    EXPECT_EQ(r.files, 4) << "run " << run;
    TokenFile train(r.train_path), val(r.val_path);
    EXPECT_EQ(decode_bytes(tokens_of(train)) + decode_bytes(tokens_of(val)), "AAAA0000BBBBCCCC");
    EXPECT_EQ(decode_bytes(tokens_of(val)), "CCCC");
  }
}

TEST(Tokens, WriterRefusesBadInput) {
  TempDir dir("tokens_writer");
  const std::string missing = (dir.path / "missing.txt").string();
  expect_usage_error([&] { write_byte_tokens(missing, dir.path.string()); },
                     {missing, "no such file or folder"});
  write_file(dir.path / "in.txt", "hello");
  const std::string in = (dir.path / "in.txt").string();
  expect_usage_error([&] { write_byte_tokens(in, (dir.path / "o").string(), 1.0); },
                     {"val_fraction 1"});
  expect_usage_error([&] { write_byte_tokens(in, (dir.path / "o").string(), 0.9); },
                     {in, "5 bytes", "0 for train.bin"});
  fs::create_directories(dir.path / "empty");
  expect_usage_error([&] { write_byte_tokens((dir.path / "empty").string(), dir.path.string()); },
                     {"0 bytes in 0 file(s)"});
  expect_usage_error([&] { write_byte_tokens(in, in, 0.5); }, {"output folder", in});
}

TEST(Tokens, DecodeRefusesIdsBeyondAByte) {
  EXPECT_EQ(decode_bytes(at::tensor({104, 105}, at::kLong)), "hi");
  const auto beyond = at::tensor({104, 300}, at::kLong);
  expect_usage_error([&] { decode_bytes(beyond); }, {"token id 300 at position 1"});
  expect_usage_error([] { decode_bytes(at::ones({2})); }, {"integer token ids"});
}

TEST(Tokens, DataTextCommandWritesTheFiles) {
  TempDir dir("tokens_cli");
  const std::string text = sample_text(2000);
  write_file(dir.path / "in.txt", text);
  const std::string out = (dir.path / "out").string();
  auto ok = run_command(cli_path() + " data text --input " + (dir.path / "in.txt").string() +
                        " --out " + out + " --val-fraction 0.25");
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("1500 tokens"), std::string::npos) << ok.output;
  TokenFile train(out + "/train.bin"), val(out + "/val.bin");
  EXPECT_EQ(decode_bytes(tokens_of(train)) + decode_bytes(tokens_of(val)), text);

  const std::string missing = (dir.path / "missing").string();
  auto bad = run_command(cli_path() + " data text --input " + missing + " --out " + out);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_EQ(bad.output, "scaletrain: text input '" + missing +
                            "': no such file or folder; give a text file or a folder of them\n");
  auto no_out = run_command(cli_path() + " data text --input " + missing);
  EXPECT_EQ(no_out.exit_code, 2) << no_out.output;
  EXPECT_NE(no_out.output.find("--out"), std::string::npos) << no_out.output;
}

// The epoch lines of a run's metrics.jsonl.
std::vector<nlohmann::json> epochs_of(const fs::path& out) {
  std::vector<nlohmann::json> epochs;
  std::ifstream in(out / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "epoch") epochs.push_back(j);
  }
  return epochs;
}

// Token files that `scaletrain data text` writes into dir/data from generated text; "" (and a
// failure) when the command fails.
std::string text_files(const fs::path& dir) {
  write_file(dir / "in.txt", sample_text(40000));
  const std::string data = (dir / "data").string();
  auto prepared = run_command(cli_path() + " data text --input " + (dir / "in.txt").string() +
                              " --out " + data);
  EXPECT_EQ(prepared.exit_code, 0) << prepared.output;
  return prepared.exit_code == 0 ? data : "";
}

// `scaletrain train` of gpt-tiny on those files: 2 epochs of 512 windows, Adam.
std::string gpt_train(const std::string& data, const std::string& out) {
  return " train --device cpu --model gpt-tiny --dataset text --data-dir " + data +
         " --no-progress --out " + out +
         " --epochs 2 --limit-train 512 --limit-test 32 --batch-size 32 --optimizer adam"
         " --lr 3e-3 --weight-decay 0";
}

// `scaletrain train --model gpt-tiny --dataset text`: the byte-level GPT learns the text under
// DDP (2 processes), its loss the per-token cross entropy, from ln 256 = 5.55 at the start.
TEST(Tokens, TrainCommandTrainsTheGptOnText) {
  TempDir dir("tokens_train");
  const std::string data = text_files(dir.path), out = (dir.path / "run").string();
  ASSERT_FALSE(data.empty());
  const std::string common = gpt_train(data, out);
  auto run = run_command(cli_path() + common + " --nproc-per-node 2");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto epochs = epochs_of(out);
  ASSERT_EQ(epochs.size(), 2u) << run.output;
  const double first = epochs[0]["loss"], second = epochs[1]["loss"];
  EXPECT_LT(second, first);
  EXPECT_LT(second, 3.5) << "the text's bytes are far from uniform (ln 256 = 5.55)";
  EXPECT_GT(epochs[1]["test_accuracy"].get<double>(), 0.2);
  // Per-token metrics on val.bin, and the throughput in tokens.
  EXPECT_NEAR(epochs[1]["test_perplexity"].get<double>(),
              std::exp(epochs[1]["test_loss"].get<double>()),
              1e-9 * epochs[1]["test_perplexity"].get<double>());
  EXPECT_LT(epochs[1]["test_perplexity"].get<double>(), 256) << "better than no guess at all";
  EXPECT_NE(run.output.find(" tokens/s"), std::string::npos) << run.output;
  // The model FLOPs utilisation, against the measured matmul peak of the CPU (flops.h).
  EXPECT_NE(run.output.find("  MFU             "), std::string::npos) << run.output;
  EXPECT_NE(run.output.find(" fp32 matmul peak per rank)"), std::string::npos) << run.output;

  auto images = run_command(cli_path() + common + " --model lenet");
  EXPECT_EQ(images.exit_code, 2) << images.output;
  EXPECT_NE(images.output.find("--dataset text is token ids, for a GPT"), std::string::npos)
      << images.output;
  auto no_files = run_command(cli_path() + " train --model gpt-tiny --dataset text --data-dir " +
                              dir.path.string() + " --out " + out);
  EXPECT_EQ(no_files.exit_code, 2) << no_files.output;
  EXPECT_NE(no_files.output.find((dir.path / "train.bin").string()), std::string::npos)
      << no_files.output;
}

// The command line's tensor parallelism on text: 2 processes split the GPT (with sequence
// parallelism and clipping), learn, and write a model.pt of the whole model; bad degrees exit 2
// naming the flag. (Transparency against one rank: tests/tensor_parallel_trainer_test.cpp.)
TEST(Tokens, TrainCommandSplitsTheGptOverTensorParallelRanks) {
  TempDir dir("tokens_train_tp");
  const std::string data = text_files(dir.path), out = (dir.path / "run").string();
  ASSERT_FALSE(data.empty());
  const std::string common = gpt_train(data, out);
  auto run = run_command(cli_path() + common +
                         " --nproc-per-node 2 --tp 2 --sequence-parallel --max-grad-norm 1"
                         " --checkpoint-blocks");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto epochs = epochs_of(out);
  ASSERT_EQ(epochs.size(), 2u) << run.output;
  EXPECT_LT(epochs[1]["loss"].get<double>(), epochs[0]["loss"].get<double>());
  EXPECT_LT(epochs[1]["loss"].get<double>(), 3.5);
  EXPECT_GT(epochs[1]["test_accuracy"].get<double>(), 0.2);
  Model whole = make_model("gpt-tiny", ModelOptions{});
  EXPECT_NO_THROW(load_weights(out + "/model.pt", *whole.module)) << "model.pt is the whole GPT";

  auto three = run_command(cli_path() + common + " --overwrite --nproc-per-node 2 --tp 3");
  EXPECT_EQ(three.exit_code, 2) << three.output;
  EXPECT_NE(three.output.find("--tp 3 does not divide the world of 2"), std::string::npos)
      << three.output;
  auto blocks = run_command(cli_path() + " train --model lenet --dataset synthetic --out " + out +
                            " --overwrite --checkpoint-blocks");
  EXPECT_EQ(blocks.exit_code, 2) << blocks.output;
  EXPECT_NE(blocks.output.find("--checkpoint-blocks recomputes a GPT's transformer blocks"),
            std::string::npos)
      << blocks.output;
  auto lone = run_command(cli_path() + common + " --overwrite --sequence-parallel");
  EXPECT_EQ(lone.exit_code, 2) << lone.output;
  EXPECT_NE(lone.output.find("--sequence-parallel"), std::string::npos) << lone.output;
}

// --vocab-size pads a GPT's vocabulary so that --tp divides it (gpt2-small's 50257 rows divide by
// no degree; nanoGPT pads them to 50304): an odd vocabulary is refused before any process starts,
// naming the padded size, and with it the split GPT trains, its model.pt holding the padded rows.
TEST(Tokens, VocabularyPaddedForTensorParallelism) {
  TempDir dir("tokens_vocab");
  const std::string data = text_files(dir.path), out = (dir.path / "run").string();
  ASSERT_FALSE(data.empty());
  const std::string common = gpt_train(data, out) + " --nproc-per-node 2 --tp 2";
  auto odd = run_command(cli_path() + common + " --vocab-size 257");
  EXPECT_EQ(odd.exit_code, 2) << odd.output;
  EXPECT_NE(odd.output.find("--tp 2 splits gpt-tiny's vocabulary of 257 rows, which it does not "
                            "divide: pad it with --vocab-size 384"),
            std::string::npos)
      << odd.output;
  auto small = run_command(cli_path() + " train --model gpt2-small --dataset text --data-dir " +
                           data + " --tp 4 --nproc-per-node 4 --out " + out);
  EXPECT_EQ(small.exit_code, 2) << small.output;
  EXPECT_NE(small.output.find("gpt2-small's vocabulary of 50257 rows, which it does not divide: "
                              "pad it with --vocab-size 50304"),
            std::string::npos)
      << small.output;
  auto bytes = run_command(cli_path() + common + " --vocab-size 200");
  EXPECT_EQ(bytes.exit_code, 2) << bytes.output;
  EXPECT_NE(bytes.output.find("at least 256 (the text data's byte tokens)"), std::string::npos)
      << bytes.output;

  auto run = run_command(cli_path() + common + " --vocab-size 384");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto epochs = epochs_of(out);
  ASSERT_EQ(epochs.size(), 2u) << run.output;
  EXPECT_LT(epochs[1]["loss"].get<double>(), 3.5) << "learns as with 256 rows";
  ModelOptions mo;
  mo.vocab_size = 384;
  Model whole = make_model("gpt-tiny", mo);
  load_weights(out + "/model.pt", *whole.module);
  EXPECT_EQ(whole.module->named_parameters()["transformer.wte.weight"].size(0), 384);
}

}  // namespace
}  // namespace scaletrain
